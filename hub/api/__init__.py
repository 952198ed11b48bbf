"""REST API v1 of the fleet controller."""
