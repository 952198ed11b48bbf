"""Recovery: the NVML adapter, GPU health signals, process-ending rules (and later the
failure classifier and recovery actions). Imports nothing else from the project but the
scheduler."""
