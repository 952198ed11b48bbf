"""The victim-set search (``scheduler/eviction.py``) against brute force, and its greedy
on zones too large to search whole."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from hypothesis import event, given, settings
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
def zones(
    draw: st.DrawFn, most: int = EXACT_LIMIT, most_nodes: int = 6
) -> tuple[dict, list[Running], Need]:
    """A zone of 8-GPU nodes partly held by candidate victims (single pods or gangs of
    whole nodes), and a request of one pod or a gang of whole-node pods."""
    nodes = draw(st.integers(1, most_nodes))
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
    for victim in chosen:  # and nothing in it is there for nothing
        assert not _fits(free, [v for v in chosen if v is not victim], need), (
            f"victim {victim.id} is not needed"
        )


def feasible_below(
    victims: Sequence[Running],
    limit: int,
    feasible: Callable[[list[Running]], bool],
    budget: int,
) -> tuple[list[Running] | None, bool]:
    """A feasible set of fewer than ``limit`` GPUs, and whether the search was complete
    (within ``budget`` checks). Feasibility only grows with more victims, so only the
    sets no further victim can join under the limit are checked."""
    ordered = sorted(victims, key=lambda v: (v.gpus, v.id))
    left = [budget]

    def search(start: int, chosen: list[Running], gpus: int) -> list[Running] | None:
        grew = False
        for i in range(start, len(ordered)):
            if gpus + ordered[i].gpus >= limit:
                break  # sorted: no later one fits under the limit either
            grew = True
            found = search(i + 1, [*chosen, ordered[i]], gpus + ordered[i].gpus)
            if found is not None or left[0] <= 0:
                return found
        if not grew:
            left[0] -= 1
            if feasible(chosen):
                return chosen
        return None

    found = search(0, [], 0)
    return found, found is not None or left[0] > 0


@settings(max_examples=300, deadline=None)
@given(zones(most=40, most_nodes=24))
def test_on_large_zones_no_set_of_half_the_gpus_would_do(zone: tuple) -> None:
    """Beyond the exhaustive search's reach (docs/scheduler.md, "Right-sized eviction"):
    the greedy's set evicts at most twice the GPUs of the cheapest feasible set, checked
    by a search for a feasible set of fewer than half its GPUs."""
    free, victims, need = zone
    fitting = sum(c // need.per_pod for c in free.values())
    found = cheapest_victims(victims, free, T, need, fitting, NOW)
    if found is None:
        return
    (gpus, _), chosen = found
    if not chosen:
        return  # it fits as things are
    half, complete = feasible_below(
        victims, (gpus + 1) // 2, lambda subset: _fits(free, subset, need), budget=20_000
    )
    event("complete search" if complete else "search budget spent")
    assert half is None, (
        f"evicts {gpus} GPUs ({[v.id for v in chosen]}); "
        f"{[v.id for v in half or ()]} free {sum(v.gpus for v in half or ())} and make room"
    )


def _job(wid: int, project: str, node: str, first: int, gpus: int, zone: str = "z") -> Running:
    pod = Pod(node, tuple(f"{node}/{first + g}" for g in range(gpus)))
    return Running(wid, project, "u", "job", T, "c", zone, (pod,), started_at=0.0)


def test_where_a_cap_asks_more_than_room_the_victims_that_count_for_it_make_the_room() -> None:
    """A 5-GPU pod over its team's cap by 5, in a zone too large to search whole: five
    GPUs of the team's jobs, those on node n1 among them, free both the cap's 5 and the
    room; evicting another project's 4-GPU job for room would add to them."""
    team = [_job(10 + i, "team", "n1", i, 1) for i in range(3)] + [_job(13, "team", "n1", 3, 2)]
    team += [_job(20 + i, "team", "n2", i, 1) for i in range(4)] + [_job(24, "team", "n2", 4, 4)]
    other = [_job(30, "x", "n0", 0, 4), _job(31, "x", "n3", 0, 4)]
    free = {("n0", T): 4, ("n1", T): 3, ("n2", T): 0, ("n3", T): 4}
    assert len(team + other) > EXACT_LIMIT  # the greedy's ground
    need = Need(5, 1, ((frozenset({"team"}), 5),))
    found = cheapest_victims(team + other, free, T, need, 0, NOW)
    assert found is not None
    cost, chosen = found
    assert cost[0] == 5 and _fits(free, chosen, need)
    assert not {30, 31} & {v.id for v in chosen}


def test_victims_in_another_zone_free_quota_but_no_room() -> None:
    """Where the gang lands (zone z) it lacks 4 GPUs of room, and its cap asks 6: the
    other zone's victim counts only for the cap."""
    here = _job(1, "p", "n1", 0, 4)
    there = _job(2, "p", "m1", 0, 8, zone="y")
    free = {("n1", T): 4, ("m1", T): 0}
    need = Need(8, 1, ((frozenset({"p"}), 6),))
    found = cheapest_victims([here, there], free, T, need, 0, NOW, zone=("c", "z", T))
    assert found is not None and sorted(v.id for v in found[1]) == [1, 2]
    # Without the cap, the other zone's victim alone frees no room where the gang lands.
    alone = cheapest_victims([there], free, T, Need(8, 1), 0, NOW, zone=("c", "z", T))
    assert alone is None


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
