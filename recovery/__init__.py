"""gpufleet.recovery"""
