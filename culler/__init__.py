"""The idle culler: idle signals, the pure idle/reclaim policy and the culler loop.

``policy.py`` decides, as a pure function, what a session's signals call for (warn, mark
idle, clear the mark, cull); ``loop.py`` runs in the controller, gathers each running
session's signals and carries the decision out; ``session_extension.py`` is the
jupyter_server extension inside each session that reports its activity and keeps the
controller's notices (a warning before a cull) for its JupyterLab front end in
``labextension/``. A session's snapshot passes run through the snapshotter's runner
(``gpufleet.snapshotter.runner``). Docs: docs/culler.md.
"""
