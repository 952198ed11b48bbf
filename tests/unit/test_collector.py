"""Garbage collection around scheduling cycles (``state/collector.py``): no
collection inside a cycle, the survivors frozen after it, and the periodic full collection
returning what became cyclic garbage after being frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from gpufleet.state.collector import collect_all, collector_paused


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _pair() -> tuple[_Node, weakref.ref[_Node]]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a reference cycle: only the collector frees it
    return a, weakref.ref(b)


@pytest.fixture(autouse=True)
def _restore_collector() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:  # what was frozen goes back after each test (``tests/conftest.py``)
        gc.enable()


def test_no_collection_runs_inside_and_the_setting_is_restored_after() -> None:
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.enable()
    gc.callbacks.append(count)
    try:
        with collector_paused():
            assert not gc.isenabled()
            garbage = [[i] for i in range(50_000)]  # far past the young threshold
            del garbage
            inside = list(collections)
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
    assert inside == []
    assert collections == [0]  # one young collection, at the end

    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()  # a caller that had it off keeps it off


def test_cyclic_garbage_of_the_block_is_freed_at_its_end() -> None:
    with collector_paused():
        pair, alive = _pair()
        del pair
    assert alive() is None


def test_a_cycle_that_dies_after_being_frozen_waits_for_the_full_collection() -> None:
    with collector_paused():
        pair, alive = _pair()  # alive through the freeze, like a request in flight
    del pair
    gc.collect()
    assert alive() is not None  # frozen: ordinary collections never look at it
    assert collect_all() >= 2
    assert alive() is None
    assert gc.get_freeze_count() > 0  # the survivors are frozen again
