"""gpufleet.agent"""
