"""The victim-set search (``scheduler/eviction.py``) against brute force, and its greedy
on zones too large to search whole."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.scheduler.eviction import EXACT_LIMIT, Need, cheapest_victims, lost_work
from gpufleet.scheduler.snapshot import Pod, Running

NOW = 10_000.0
T = "H100"


def _fits(free: dict[tuple[str, str], int], victims: list[Running], need: Need) -> bool:
    counts = dict(free)
    for victim in victims:
        for pod in victim.pods:
            counts[(pod.node, T)] += len(pod.gpus)
    pods = sum(c // need.per_pod for c in counts.values())
    freed_ok = all(
        sum(v.gpus for v in victims if projects is None or v.project in projects) >= gpus
        for projects, gpus in need.quotas
    )
    return pods >= need.pods and freed_ok


def _cost(victims: list[Running]) -> tuple[int, float]:
    return (sum(v.gpus for v in victims), sum(lost_work(v, NOW) for v in victims))


@st.composite
def zones(draw: st.DrawFn, most: int = EXACT_LIMIT) -> tuple[dict, list[Running], Need]:
    """A zone of 8-GPU nodes partly held by candidate victims (single pods or gangs of
    whole nodes), and a request of one pod or a gang of whole-node pods."""
    nodes = draw(st.integers(1, 6))
    used = {f"n{i}": 0 for i in range(nodes)}
    victims: list[Running] = []
    for wid in range(draw(st.integers(0, most))):
        if draw(st.booleans()) and nodes > 1:  # a gang of whole free nodes
            empty = [n for n, u in used.items() if u == 0]
            if len(empty) < 2:
                continue
            width = draw(st.integers(2, len(empty)))
            pods = tuple(Pod(n, tuple(f"{n}/{g}" for g in range(8))) for n in empty[:width])
            for n in empty[:width]:
                used[n] = 8
        else:
            node = draw(st.sampled_from(sorted(used)))
            room = 8 - used[node]
            if room == 0:
                continue
            gpus = draw(st.integers(1, room))
            pods = (Pod(node, tuple(f"{node}/{used[node] + g}" for g in range(gpus))),)
            used[node] += gpus
        victims.append(
            Running(
                id=wid,
                project=draw(st.sampled_from(("a", "b"))),
                user="u",
                kind="job",
                gpu_type=T,
                cluster="c",
                zone="z",
                pods=pods,
                started_at=NOW - draw(st.integers(0, 5000)),
                last_progress_at=NOW - draw(st.integers(0, 5000)),
                idle_reclaimable=draw(st.booleans()) and draw(st.booleans()),
            )
        )
    free = {(n, T): 8 - u for n, u in used.items()}
    if draw(st.booleans()):
        need = Need(draw(st.integers(1, 8)), 1)
    else:
        need = Need(8, draw(st.integers(1, nodes)))
    if draw(st.booleans()):
        need = Need(need.per_pod, need.pods, ((frozenset({"a"}), draw(st.integers(1, 8))),))
    return free, victims, need


@settings(max_examples=300, deadline=None)
@given(zones())
def test_the_victims_are_the_cheapest_feasible_set(zone: tuple) -> None:
    free, victims, need = zone
    fitting = sum(c // need.per_pod for c in free.values())
    found = cheapest_victims(victims, free, T, need, fitting, NOW)
    feasible = [
        list(subset)
        for size in range(len(victims) + 1)
        for subset in itertools.combinations(victims, size)
        if _fits(free, list(subset), need)
    ]
    if not feasible:
        assert found is None
        return
    assert found is not None
    cost, chosen = found
    assert _fits(free, chosen, need), "the set found makes room"
    assert cost == _cost(chosen)
    best = min(_cost(s) for s in feasible)
    assert cost[0] == best[0], f"{cost} evicts more GPUs than the best {best}"
    assert abs(cost[1] - best[1]) < 1e-6, f"{cost} loses more work than the best {best}"


@settings(max_examples=100, deadline=None)
@given(zones(most=40))
def test_on_large_zones_the_greedy_evicts_at_most_twice_a_single_victim_that_suffices(
    zone: tuple,
) -> None:
    """Beyond the exhaustive search's reach the answer is the greedy's: feasible, never
    worse than the cheapest single victim that makes room alone, and within twice the
    need when one victim of at most twice the need suffices."""
    free, victims, need = zone
    fitting = sum(c // need.per_pod for c in free.values())
    found = cheapest_victims(victims, free, T, need, fitting, NOW)
    singles = [v for v in victims if _fits(free, [v], need)]
    if found is None:
        assert not singles and not _fits(free, victims, need)
        return
    cost, chosen = found
    assert _fits(free, chosen, need)
    if singles:
        assert cost[0] <= min(v.gpus for v in singles)


def test_a_gang_evicts_the_small_job_not_the_big_one() -> None:
    """Two nodes: one holds a 16-GPU gang's half, the other a 2-GPU job and 6 free. A 2-GPU
    session fits once the 2-GPU job is gone: the gang stays."""
    gang = Running(
        1,
        "a",
        "u",
        "job",
        T,
        "c",
        "z",
        (
            Pod("n0", tuple(f"n0/{g}" for g in range(8))),
            Pod("n2", tuple(f"n2/{g}" for g in range(8))),
        ),
        started_at=0.0,
    )
    small = Running(2, "a", "u", "job", T, "c", "z", (Pod("n1", ("n1/0", "n1/1")),), started_at=0.0)
    free = {("n0", T): 0, ("n1", T): 6, ("n2", T): 0}
    found = cheapest_victims([gang, small], free, T, Need(8, 1), 0, NOW)
    assert found is not None and [v.id for v in found[1]] == [2]
