"""gpufleet.hub"""
