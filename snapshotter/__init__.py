"""The snapshotter: snapshot format, capture, restore, S3 and local stores, retention.

It arrives with the snapshotter issue; the folder exists so the layout matches DESIGN.md.
"""
