"""gpufleet.hub.api"""
