"""Retrying what a later attempt may cure (``errors.Transient``), and nothing else."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import Transient

log = logging.getLogger(__name__)
T = TypeVar("T")


def with_retries(
    action: Callable[[], T],
    what: str,
    *,
    attempts: int = 5,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
) -> T:
    """Run ``action``; on a ``Transient`` error wait (doubling, capped) and try again, up to
    ``attempts`` times in all, then let the last error through."""
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Transient as e:
            if attempt == attempts:
                raise
            log.warning(
                "%s failed (%s); retry %d of %d in %.1f s", what, e, attempt, attempts - 1, delay
            )
            time.sleep(delay)  # back-off between attempts, not synchronisation
            delay = min(delay * 2, max_delay_s)
    raise AssertionError("unreachable")
