"""The per-cluster managers: turning the scheduler's decisions into processes (through node
agents) or pods (Kubernetes) (DESIGN.md, "The folders").

``workload_processes.py``: what a spawner needs to mark every process of a workload it
starts and, on the local backend, to end them all before the GPUs are released.
"""
