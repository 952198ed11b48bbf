"""The node agent: GPU inventory, samples, XID events and metrics through NVML, and the
rank runner for job ranks on the local backend."""
