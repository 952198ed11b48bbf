"""A producer's tracked maps record every change a snapshot's ``Changes`` must carry, and a
memo given changes that do not lead from the snapshot it saw last reads the snapshot whole."""

from __future__ import annotations

from gpufleet.scheduler.memo import PlanMemo
from gpufleet.scheduler.model import ProjectTree
from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.snapshot import Changes, NodeState, Pending, SchedulingSnapshot
from gpufleet.scheduler.tracked import ChangeStream, TrackedMap


def test_every_way_of_changing_a_tracked_map_is_recorded() -> None:
    tracked: TrackedMap[str] = TrackedMap()
    tracked[1] = "a"
    tracked.update({2: "b"}, **{})
    tracked |= {3: "c"}
    tracked.setdefault(4, "d")
    tracked.setdefault(1, "ignored")
    assert tracked.take_changes() == {1: "a", 2: "b", 3: "c", 4: "d"}
    assert tracked.take_changes() == {}
    del tracked[1]
    assert tracked.pop(2) == "b"
    assert tracked.pop(99, None) is None  # absent: nothing to record
    key, _ = tracked.popitem()
    assert tracked.take_changes() == {1: None, 2: None, key: None}
    tracked[5] = "e"
    left = set(tracked)
    tracked.clear()
    assert tracked.take_changes() == dict.fromkeys(left) and left == {3, 5} and not tracked


def _request(wid: int) -> Pending:
    return Pending(wid, "vision", "alice", "session", "A100", 1)


def _snapshot(queue: tuple[Pending, ...], changes: Changes | None) -> SchedulingSnapshot:
    node = NodeState("n1", "c", "z", "A100", 1, ())  # full: everything waits
    return SchedulingSnapshot((node,), (), queue, ProjectTree({}), changes=changes)


def test_a_memo_reads_the_snapshot_whole_when_the_changes_do_not_follow_on() -> None:
    stream, memo = ChangeStream(), PlanMemo()
    stream.queue[1] = _request(1)
    first = plan(_snapshot((_request(1),), stream.changes()), 0.0, memo)
    assert [w.workload_id for w in first.waiting] == [1]
    stream.changes()  # a snapshot the memo never saw: the next changes skip a serial
    stream.queue[2] = _request(2)
    skipped = _snapshot((_request(1), _request(2)), stream.changes())
    assert [w.workload_id for w in plan(skipped, 1.0, memo).waiting] == [1, 2]
    # A producer that forgot a change: the counts disagree, the memo reads it whole.
    forgot = Changes(skipped.changes.stream, skipped.changes.serial + 1, {}, {})  # type: ignore[union-attr]
    three = _snapshot((_request(1), _request(2), _request(3)), forgot)
    assert [w.workload_id for w in plan(three, 2.0, memo).waiting] == [1, 2, 3]
