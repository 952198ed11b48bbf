"""gpufleet.snapshotter"""
