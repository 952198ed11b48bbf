"""The free-GPU index a memo carries across cycles (``placement.FreeIndex.follow``) equals
one built afresh from the same nodes, down to the order of equally free nodes inside a
zone, which decides where a pod lands; and a cycle's ``Capacity`` takes GPUs from its own
copy, never from the index the next cycle starts from."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.scheduler.placement import Capacity, FreeIndex
from gpufleet.scheduler.snapshot import NodeState

ZONES = [("c1", "z1"), ("c1", "z2"), ("c2", "z1")]
TYPES = ["A100", "H100"]


def node(i: int, zone: int, gpu_type: int, total: int, free: int, up: bool) -> NodeState:
    cluster, name = ZONES[zone]
    gpus = tuple(f"g{g}" for g in range(total))
    return NodeState(f"n{i}", cluster, name, TYPES[gpu_type], total, gpus[:free], up)


def layout(index: FreeIndex) -> dict[str, Any]:
    """Everything a cycle reads of an index, with the order that matters kept."""
    return {
        "nodes": sorted(index.nodes.items(), key=lambda kv: kv[0]),
        "zone_of": sorted(index.zone_of.items()),
        "buckets": {
            zone: {count: list(keys) for count, keys in by_count.items() if keys}
            for zone, by_count in sorted(index.buckets.items())
        },
        "zone_free": sorted(index.zone_free.items()),
        "zones_by_type": sorted(index.zones_by_type.items()),
        "free_by_type": sorted(index.free_by_type.items()),
        "total_by_type": sorted(index.total_by_type.items()),
        "zone_totals": sorted(index.shape.totals_by_zone.items()),
    }


changes = st.lists(
    st.tuples(
        st.integers(0, 11),  # which node
        st.sampled_from(["take", "free", "down", "up", "resize"]),
        st.integers(0, 8),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 12), st.randoms(use_true_random=False), changes)
def test_an_index_followed_through_changes_equals_a_fresh_one(
    count: int, rnd: Any, steps: list[tuple[int, str, int]]
) -> None:
    nodes = [
        node(i, rnd.randrange(len(ZONES)), rnd.randrange(2), 8, rnd.randrange(9), True)
        for i in range(count)
    ]
    index = FreeIndex(nodes)
    for which, change, amount in steps:
        which %= count
        was = nodes[which]
        gpus = tuple(f"g{g}" for g in range(was.total))
        if change == "take":
            nodes[which] = replace(was, free=was.free[: max(0, len(was.free) - amount)])
        elif change == "free":
            nodes[which] = replace(was, free=gpus[: min(was.total, len(was.free) + amount)])
        elif change in ("down", "up"):
            nodes[which] = replace(was, schedulable=change == "up")
        else:  # lost GPUs: the node's size changes, and with it the fleet's shape
            total = max(1, amount)
            nodes[which] = replace(was, total=total, free=was.free[:total])
        index = FreeIndex.follow(index, nodes)
        assert layout(index) == layout(FreeIndex(nodes))


def test_a_cycle_takes_from_its_own_copy_and_the_next_starts_whole() -> None:
    nodes = [node(i, 0, 0, 8, 8, True) for i in range(3)]
    index = FreeIndex(nodes)
    before = layout(index)
    cycle = Capacity(index)
    zone = ("c1", "z1", "A100")
    pods = cycle.place(zone, 4, 3)
    assert [p.node for p in pods] == ["n0", "n0", "n1"]  # best fit: a half-used node first
    assert cycle.free_by_type["A100"] == 12
    assert layout(index) == before
    again = Capacity(index)
    assert again.free_by_type["A100"] == 24
    assert again.pods_fitting(zone, 8) == 3


def test_a_renamed_node_rebuilds_the_index() -> None:
    nodes = [node(i, i % 2, 0, 8, 8, True) for i in range(4)]
    index = FreeIndex(nodes)
    nodes[1] = replace(nodes[1], name="other")
    followed = FreeIndex.follow(index, nodes)
    assert followed is not index
    assert layout(followed) == layout(FreeIndex(nodes))
