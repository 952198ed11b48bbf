"""The fleet controller service: REST API, pages, loops, metrics, and the JupyterHub setup."""
