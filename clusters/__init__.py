"""The per-cluster managers: turning the scheduler's decisions into processes (through node
agents) or pods (Kubernetes) (DESIGN.md, "The folders").

- ``kube_config.py``: the configured clusters and a ``kubernetes_asyncio`` client for each;
- ``manifests.py``: the pure builders of every object gpufleet makes for a session;
- ``node_watch.py``, ``node_stream.py``: each cluster's Node watch and its pure reading;
- ``workload_processes.py``: what a spawner needs to mark every process of a workload it
  starts and, on the local backend, to end them all before the GPUs are released.
"""
