"""The idle culler: idle signals, the pure idle/reclaim policy and the culler loop.

It arrives with the idle culler issue; the folder exists so the layout matches DESIGN.md.
"""
