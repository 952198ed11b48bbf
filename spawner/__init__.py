"""gpufleet.spawner"""
