"""The culler's exceptions: one tree, so callers catch ``CullerError`` at their edge."""

from __future__ import annotations


class CullerError(Exception):
    """Anything the culler cannot do, with a message that says what to fix."""


class PolicyError(CullerError, ValueError):
    """An idle policy in the configuration that cannot be used."""
