"""gpufleet.culler"""
