"""The store against real databases: SQLite and PostgreSQL (the ``engine`` fixture runs both).

Migrations, the schema check, the invariants the schema enforces, and FleetStore's flows:
admission with quotas, ending, lease expiry, fencing of a second controller, node health.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, func, inspect, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpufleet.scheduler.errors import InvalidRequest, LeaseLost, SchemaMismatch
from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import Catalogue, ProfileRule, SessionRequest
from gpufleet.state import db
from gpufleet.state.catalogue import catalogue_of, projects_of
from gpufleet.state.cycle import AdmittedWait, CycleResult
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec
from gpufleet.state.models import (
    Allocation,
    Base,
    Cluster,
    ControllerLease,
    Event,
    Gpu,
    Node,
    NodeHealth,
    Project,
    Workload,
    WorkloadKind,
    WorkloadState,
    Zone,
)

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
REQUEST_LEASE = timedelta(seconds=30)
APP_TABLES = {t.name for t in Base.metadata.sorted_tables}


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# ------------------------------------------------------------------ migrations
def test_upgrade_creates_every_table_at_head_and_downgrade_removes_them(
    empty_engine: Engine,
) -> None:
    assert db.is_empty(empty_engine)
    assert db.current_revision(empty_engine) is None

    db.upgrade(empty_engine)
    assert db.current_revision(empty_engine) == db.head_revision()
    assert set(inspect(empty_engine).get_table_names()) == APP_TABLES | {"alembic_version"}
    assert not db.is_empty(empty_engine)
    db.check_schema(empty_engine)  # at head: no complaint

    db.downgrade(empty_engine, "base")
    assert db.current_revision(empty_engine) is None
    assert set(inspect(empty_engine).get_table_names()) == {"alembic_version"}

    db.upgrade(empty_engine)  # and back up again, cleanly
    assert db.current_revision(empty_engine) == db.head_revision()


def test_the_migrations_build_exactly_what_the_models_declare(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_check_schema_on_an_empty_database_names_the_upgrade_command(
    empty_engine: Engine,
) -> None:
    with pytest.raises(SchemaMismatch, match="has no gpufleet schema") as caught:
        db.check_schema(empty_engine)
    assert "`gpufleet-controller upgrade-db`" in str(caught.value)


def test_check_schema_after_a_downgrade_to_base_names_the_upgrade_command(
    engine: Engine,
) -> None:
    db.downgrade(engine, "base")
    with pytest.raises(SchemaMismatch, match="`gpufleet-controller upgrade-db`"):
        db.check_schema(engine)


def test_check_schema_refuses_a_database_from_a_newer_gpufleet(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(SchemaMismatch) as caught:
        db.check_schema(engine)
    message = str(caught.value)
    assert "revision 9999, which this version of gpufleet does not know" in message
    assert f"it expects {db.head_revision()}" in message


# ------------------------------------------------------ schema-level invariants
def _seed_one_gpu_and_two_workloads(session: Session) -> tuple[int, int, int]:
    """One project, one node with one GPU, two workloads; returns their ids."""
    project = Project(name="vision")
    zone = Zone(cluster=Cluster(name="local"), name="zone-a")
    node = Node(name="a1", zone=zone, gpu_type="A100")
    session.add_all([project, node])
    session.flush()
    session.add(Gpu(uuid="GPU-a1-0", node_id=node.id, index=0, gpu_type="A100"))
    workloads = [
        Workload(
            kind=WorkloadKind.session,
            project=project,
            username=user,
            gpu_type="A100",
            gpus_per_pod=1,
            created_at=T0,
        )
        for user in ("alice", "bob")
    ]
    session.add_all(workloads)
    session.flush()
    return node.id, workloads[0].id, workloads[1].id


def _allocation(session: Session, workload_id: int, opened_at: datetime) -> Allocation:
    workload = session.get_one(Workload, workload_id)
    return Allocation(
        workload_id=workload_id,
        gpu_uuid="GPU-a1-0",
        node_id=session.get_one(Gpu, "GPU-a1-0").node_id,
        project_id=workload.project_id,
        username=workload.username,
        gpu_type="A100",
        opened_at=opened_at,
    )


def test_one_gpu_cannot_have_two_open_allocations(engine: Engine) -> None:
    factory = db.session_factory(engine)
    with db.transaction(factory) as session:
        _, first, second = _seed_one_gpu_and_two_workloads(session)
        session.add(_allocation(session, first, t(1)))

    with pytest.raises(IntegrityError), db.transaction(factory) as session:
        session.add(_allocation(session, second, t(2)))

    with db.transaction(factory) as session:  # once the first is closed, the GPU is free
        session.execute(update(Allocation).values(closed_at=t(3)))
        session.add(_allocation(session, second, t(4)))
    with factory() as session:
        rows = session.execute(
            select(Allocation.workload_id, Allocation.closed_at).order_by(Allocation.id)
        ).all()
    assert rows == [(first, t(3)), (second, None)]


# ------------------------------------------------------------------ FleetStore
PROJECTS: list[dict[str, Any]] = [
    {
        "name": "vision",
        "display_name": "Computer vision",
        "quotas": {"A100": {"guaranteed": 2, "borrow_limit": 0}},
    },
    {"name": "nlp", "quotas": {"A100": {"guaranteed": 4}, "H100": {"guaranteed": 2}}},
]
PROFILES: list[dict[str, Any]] = [
    {"name": "pytorch", "default": True},
    {"name": "jax", "gpu_types": ["H100"]},
]
PRIORITY_CLASSES = [{"name": "standard", "rank": 100}]
GROUPS = {"vision": ["alice", "bob"], "nlp": ["carol"]}


def node_spec(name: str, gpu_type: str, indices: Iterable[int]) -> NodeSpec:
    return NodeSpec(
        name=name,
        cluster="local",
        zone="zone-a",
        gpu_type=gpu_type,
        gpus=tuple(GpuSpec(f"GPU-{name}-{i}", i) for i in indices),
    )


NODES = [
    node_spec("a1", "A100", range(4)),
    node_spec("a2", "A100", range(2)),
    node_spec("h1", "H100", range(2)),
]


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def make_store(engine: Engine) -> FleetStore:
    """A controller holding the lease over a small fleet: 6 A100 on two nodes, 2 H100."""
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(seconds=15))
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(T0, PROJECTS, PROFILES, PRIORITY_CLASSES)
    assert store.nodes.register_nodes(T0, "agent-1", NODES) == ["a1", "a2", "h1"]
    assert store.projects.sync_memberships(T0, GROUPS) == 3
    return store


def cycle(store: FleetStore, now: datetime) -> CycleResult:
    return store.scheduling.scheduling_cycle(now, Policy())


def ask(
    store: FleetStore,
    now: datetime,
    username: str,
    *,
    server: str = "",
    project: str = "vision",
    gpu_type: str = "A100",
    gpus: object = 1,
    profile: str | None = None,
) -> int:
    request = SessionRequest(username, server, project, gpu_type, gpus, profile)
    return store.workloads.open_session_request(now, request, REQUEST_LEASE).id


def workload(store: FleetStore, workload_id: int) -> Workload:
    with store.read() as session:
        found = session.get(Workload, workload_id)
        assert found is not None
        return found


def allocations(store: FleetStore) -> list[tuple[int, str, datetime | None]]:
    with store.read() as session:
        return [
            tuple(row)
            for row in session.execute(
                select(Allocation.workload_id, Allocation.gpu_uuid, Allocation.closed_at).order_by(
                    Allocation.id
                )
            )
        ]


def row_counts(engine: Engine) -> dict[str, object]:
    """Rows per table, and the lease's expiry (every fenced write renews it)."""
    with engine.connect() as connection:
        counts: dict[str, object] = {
            table.name: connection.execute(select(func.count()).select_from(table)).scalar_one()
            for table in Base.metadata.sorted_tables
        }
        counts["lease expires at"] = connection.execute(
            select(ControllerLease.expires_at)
        ).scalar_one()
    return counts


def events(store: FleetStore, kind: str) -> list[str]:
    with store.read() as session:
        return list(
            session.scalars(select(Event.message).where(Event.kind == kind).order_by(Event.id))
        )


def test_a_cycle_admits_within_the_quota_and_queues_beyond_it_with_the_reason(
    store: FleetStore,
) -> None:
    alice = ask(store, t(1), "alice")
    bob = ask(store, t(2), "bob")
    alice_again = ask(store, t(3), "alice", server="second")

    result = cycle(store, t(4))
    assert result.admitted == (
        AdmittedWait(alice, "vision", "A100", 3.0),
        AdmittedWait(bob, "vision", "A100", 2.0),
    )
    assert (result.stops, result.changed) == ((), (alice, bob, alice_again))
    # Best fit: the 2-GPU node a2 fills up first, a1 stays whole.
    assert allocations(store) == [(alice, "GPU-a2-0", None), (bob, "GPU-a2-1", None)]
    assert workload(store, alice).state == WorkloadState.admitted
    assert workload(store, alice).reason == "admitted on a2 (zone-a)"
    waiting = workload(store, alice_again)
    assert waiting.state == WorkloadState.pending
    assert waiting.queue_position == 1
    assert waiting.reason == (
        "Waiting for project vision's GPUs to free up: needs 1 × A100, project vision uses "
        "2/2 guaranteed A100 and may borrow 0 more"
    )
    assert events(store, "waiting") == [
        f"workload {alice_again} waits: Waiting for project vision's GPUs to free up: needs "
        "1 × A100, project vision uses 2/2 guaranteed A100 and may borrow 0 more"
    ]
    # Nothing changed: the next cycle decides nothing and records nothing.
    quiet = cycle(store, t(5))
    assert (quiet.admitted, quiet.stops, quiet.changed) == ((), (), ())
    assert len(events(store, "waiting")) == 1


def test_ending_closes_allocations_without_deleting_them_and_frees_the_gpu(
    store: FleetStore,
) -> None:
    alice = ask(store, t(1), "alice", gpus=2)
    bob = ask(store, t(2), "bob")
    cycle(store, t(3))
    assert workload(store, bob).state == WorkloadState.pending

    ended = store.workloads.end(t(10), alice, "stopped", "the user stopped the server")
    assert (ended.state, ended.outcome, ended.ended_at) == (WorkloadState.ended, "stopped", t(10))
    assert allocations(store) == [
        (alice, "GPU-a2-0", t(10)),
        (alice, "GPU-a2-1", t(10)),
    ]

    result = cycle(store, t(11))
    assert result.admitted == (AdmittedWait(bob, "vision", "A100", 9.0),)
    assert allocations(store) == [
        (alice, "GPU-a2-0", t(10)),
        (alice, "GPU-a2-1", t(10)),
        (bob, "GPU-a2-0", None),
    ]
    # Ending twice changes nothing: the end time stays the first one.
    assert store.workloads.end(t(20), alice, "failed", "again").ended_at == t(10)


def test_an_unrenewed_request_expires_and_a_renewed_or_running_one_does_not(
    store: FleetStore,
) -> None:
    alice = ask(store, t(0), "alice")
    bob = ask(store, t(0), "bob")
    carol = ask(store, t(0), "carol", project="nlp")
    store.workloads.renew(t(20), bob, REQUEST_LEASE)  # bob's spawner still waits: lease until t(50)

    assert store.workloads.expire_leases(t(29)) == []
    assert sorted(store.workloads.expire_leases(t(31))) == [alice, carol]
    for gone in (alice, carol):
        expired = workload(store, gone)
        assert (expired.state, expired.outcome) == (WorkloadState.ended, "expired")
        assert "stopped renewing" in expired.reason
    assert workload(store, bob).state == WorkloadState.pending

    cycle(store, t(32))
    store.workloads.mark_running(t(33), bob)
    assert store.workloads.expire_leases(t(1000)) == []  # a running session holds no request lease
    assert workload(store, bob).state == WorkloadState.running


def test_an_admitted_request_whose_lease_lapses_gives_its_gpus_back(store: FleetStore) -> None:
    alice = ask(store, t(0), "alice")
    cycle(store, t(1))
    assert store.workloads.expire_leases(t(31)) == [alice]
    assert allocations(store) == [(alice, "GPU-a2-0", t(31))]


def test_a_new_start_of_the_same_server_supersedes_the_older_request(store: FleetStore) -> None:
    first = ask(store, t(1), "alice")
    other_server = ask(store, t(2), "alice", server="gpu2")
    second = ask(store, t(3), "alice")  # the spawn was retried while the first still waited

    old = workload(store, first)
    assert (old.state, old.outcome, old.ended_at) == (WorkloadState.ended, "superseded", t(3))
    assert old.reason == "a new start of the same server replaced this request"
    assert workload(store, other_server).state == WorkloadState.pending  # another server

    cycle(store, t(4))
    assert allocations(store) == [(other_server, "GPU-a2-0", None), (second, "GPU-a2-1", None)]
    third = ask(store, t(5), "alice")  # superseding an admitted request gives its GPU back
    assert workload(store, second).outcome == "superseded"
    assert allocations(store) == [(other_server, "GPU-a2-0", None), (second, "GPU-a2-1", t(5))]
    assert workload(store, third).state == WorkloadState.pending


def test_a_running_server_cannot_be_requested_again(store: FleetStore, engine: Engine) -> None:
    first = ask(store, t(1), "alice")
    cycle(store, t(2))
    store.workloads.mark_running(t(3), first)
    before = row_counts(engine)

    with pytest.raises(InvalidRequest) as caught:
        ask(store, t(4), "alice")
    assert str(caught.value) == (
        f"server (default) of alice still holds GPUs as workload {first} (running); stop it "
        "before starting it again"
    )
    assert row_counts(engine) == before
    assert workload(store, first).state == WorkloadState.running


def test_a_second_controller_waits_for_the_lease_and_then_fences_the_first(
    store: FleetStore, engine: Engine
) -> None:
    second = FleetStore(engine, "controller-b", lease_ttl=timedelta(seconds=15))
    assert not second.try_acquire_lease(t(5))  # held until t(15)
    store.nodes.heartbeat(t(10), "agent-1", ["a1"])  # every write renews: held until t(25)
    assert not second.try_acquire_lease(t(20))
    with pytest.raises(LeaseLost):  # a controller that never held the lease cannot write
        second.nodes.heartbeat(t(20), "agent-1", ["a1"])

    assert second.try_acquire_lease(t(26))  # the first stopped renewing: taken over
    alice = ask(second, t(27), "alice")  # the new holder writes
    before = row_counts(engine)

    writes: list[Callable[[datetime], object]] = [
        lambda now: ask(store, now, "bob"),
        lambda now: cycle(store, now),
        lambda now: store.workloads.end(now, alice, "stopped", ""),
        lambda now: store.workloads.renew(now, alice, REQUEST_LEASE),
        lambda now: store.workloads.expire_leases(now + timedelta(hours=1)),
        lambda now: store.nodes.heartbeat(now, "agent-1", ["a1"]),
        lambda now: store.jobs.lose_silent_nodes(now, timedelta(seconds=0)),
        lambda now: store.nodes.register_nodes(now, "agent-1", [node_spec("a3", "A100", [0])]),
        lambda now: store.projects.sync_memberships(now, {}),
        lambda now: store.projects.apply_config(now, [], [], [{"name": "low", "rank": 1}]),
        lambda now: store.events.record_event(now, "snapshot-retention", "from the old controller"),
    ]
    for write in writes:
        with pytest.raises(LeaseLost, match="controller-a no longer holds the database lease"):
            write(t(28))
    assert row_counts(engine) == before  # nothing of the fenced-off writes was committed
    assert not store.try_acquire_lease(t(29))
    with engine.connect() as connection:
        lease = connection.execute(select(ControllerLease.holder, ControllerLease.epoch)).one()
    assert tuple(lease) == ("controller-b", 2)
    assert workload(second, alice).state == WorkloadState.pending


def test_a_lease_given_up_is_taken_at_once_and_fences_its_old_holder(
    store: FleetStore, engine: Engine
) -> None:
    second = FleetStore(engine, "controller-b", lease_ttl=timedelta(seconds=15))
    assert not second.try_acquire_lease(t(5))
    assert not second.release_lease(t(5))  # not its to give up
    assert store.release_lease(t(6))  # a clean stop, 9 s before the lease would lapse
    assert second.try_acquire_lease(t(6))
    with pytest.raises(LeaseLost):
        store.nodes.heartbeat(t(7), "agent-1", ["a1"])
    assert not store.release_lease(t(8))  # no longer held: the new holder keeps it
    assert not store.try_acquire_lease(t(8))


def test_a_restarted_controller_with_the_same_name_fences_its_old_self(
    store: FleetStore, engine: Engine
) -> None:
    restarted = FleetStore(engine, "controller-a")
    assert restarted.try_acquire_lease(t(1))  # its own lease, although still live
    assert restarted.database.epoch == 2
    with pytest.raises(LeaseLost):
        ask(store, t(2), "alice")
    assert workload(restarted, ask(restarted, t(3), "alice")).state == WorkloadState.pending


def test_a_fenced_off_write_gives_its_connection_back_at_once(
    store: FleetStore, engine: Engine
) -> None:
    second = FleetStore(engine, "controller-b")
    assert second.try_acquire_lease(t(100))
    with pytest.raises(LeaseLost) as caught:  # the caller still holds the error, as a log may
        store.nodes.heartbeat(t(101), "agent-1", ["a1"])
    still_open = engine.pool.checkedout()  # type: ignore[attr-defined]
    del caught  # the leaked transaction is cleaned up only with the error: do not leak it on
    gc.collect()
    assert still_open == 0, "the fenced-off transaction is still open"


def test_silent_nodes_become_unknown_and_receive_no_work_until_they_report(
    store: FleetStore,
) -> None:
    assert store.nodes.heartbeat(t(20), "agent-1", ["a1", "ghost"]) == ["ghost"]
    assert store.jobs.lose_silent_nodes(t(31), timedelta(seconds=30)).nodes == ["a2", "h1"]
    with store.read() as session:
        health = dict(session.execute(select(Node.name, Node.health)).all())
    assert health == {"a1": NodeHealth.ok, "a2": NodeHealth.unknown, "h1": NodeHealth.unknown}

    alice = ask(store, t(32), "alice")
    carol = ask(store, t(33), "carol", project="nlp", gpu_type="H100")
    cycle(store, t(34))
    assert allocations(store) == [(alice, "GPU-a1-0", None)]  # best fit would pick a2
    assert workload(store, carol).reason == (
        "Waiting for 1 GPU on one node: every node with H100 is cordoned, unhealthy or silent "
        "right now; within project nlp's guarantee (0/2 used)"
    )

    store.nodes.heartbeat(t(40), "agent-1", ["h1"])
    assert cycle(store, t(41)).admitted == (AdmittedWait(carol, "nlp", "H100", 8.0),)
    assert events(store, "node-back") == ["node h1 is reporting again"]


def test_a_gpu_that_is_no_longer_reported_is_marked_absent_and_not_offered(
    store: FleetStore,
) -> None:
    store.nodes.register_nodes(t(5), "agent-1", [node_spec("a1", "A100", (0, 1, 2))])
    with store.read() as session:
        present = dict(
            session.execute(select(Gpu.uuid, Gpu.present).where(Gpu.uuid.like("GPU-a1-%"))).all()
        )
        catalogue = catalogue_of(session, "carol")
    assert present == {"GPU-a1-0": True, "GPU-a1-1": True, "GPU-a1-2": True, "GPU-a1-3": False}
    assert events(store, "gpu-missing") == ["GPU GPU-a1-3 (index 3) is no longer reported on a1"]
    assert catalogue.largest_node == {"A100": 3, "H100": 2}

    with pytest.raises(InvalidRequest, match="the largest A100 node has 3"):
        ask(store, t(6), "carol", project="nlp", gpus=4)
    carol = ask(store, t(7), "carol", project="nlp", gpus=3)
    cycle(store, t(8))
    assert [uuid for _, uuid, _ in allocations(store)] == ["GPU-a1-0", "GPU-a1-1", "GPU-a1-2"]
    assert workload(store, carol).state == WorkloadState.admitted


def test_catalogue_offers_the_users_projects_types_and_profiles(store: FleetStore) -> None:
    with store.read() as session:
        assert catalogue_of(session, "alice") == Catalogue(
            largest_node={"A100": 4, "H100": 2},
            user_projects=frozenset({"vision"}),
            profiles={
                "jax": ProfileRule(gpu_types=("H100",)),
                "pytorch": ProfileRule(is_default=True),
            },
            # A job's gang stays in one zone: the most of each type one zone holds.
            largest_zone={"A100": 6, "H100": 2},
            priority_classes=frozenset({"standard"}),
        )
        assert catalogue_of(session, "mallory").user_projects == frozenset()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus": "two"}, "whole number"),
        ({"gpus": 0}, "at least 1 GPU"),
        ({"project": "nlp"}, "alice is not a member of project 'nlp'"),
        ({"gpu_type": "V100"}, "unknown GPU type 'V100'; this fleet has: A100, H100"),
        ({"gpus": 5}, "the largest A100 node has 4"),
        ({"profile": "jax"}, "profile 'jax' runs on H100, not 'A100'"),
        ({"username": "mallory"}, "mallory is in no gpufleet project"),
    ],
)
def test_bad_requests_are_rejected_without_writing_anything(
    store: FleetStore, engine: Engine, changes: dict[str, Any], message: str
) -> None:
    fields: dict[str, Any] = {"username": "alice", "server_name": "", "project": "vision"}
    fields |= {"gpu_type": "A100", "gpus": 1, "profile": None} | changes
    request = SessionRequest(**fields)
    before = row_counts(engine)

    with pytest.raises(InvalidRequest, match=message):
        store.workloads.check_session_request(request)
    with pytest.raises(InvalidRequest, match=message):
        store.workloads.open_session_request(t(1), request, REQUEST_LEASE)
    assert row_counts(engine) == before


def test_a_valid_dry_run_records_nothing(store: FleetStore, engine: Engine) -> None:
    before = row_counts(engine)
    store.workloads.check_session_request(SessionRequest("alice", "", "vision", "A100", "2"))
    assert row_counts(engine) == before


def test_memberships_follow_the_hub_groups(store: FleetStore) -> None:
    assert store.projects.sync_memberships(t(1), GROUPS) == 0
    assert (
        store.projects.sync_memberships(t(2), {"vision": ["alice"], "nlp": ["carol", "bob"]}) == 2
    )
    with store.read() as session:
        assert [p.name for p in projects_of(session, "bob")] == ["nlp"]
    with pytest.raises(InvalidRequest, match="bob is not a member of project 'vision'"):
        ask(store, t(3), "bob")
    assert workload(store, ask(store, t(4), "bob", project="nlp")).state == WorkloadState.pending


def test_apply_config_updates_quotas_in_place(store: FleetStore) -> None:
    changed = [
        {
            "name": "vision",
            "quotas": {"H100": {"guaranteed": 1, "borrow_limit": 0}},
            "per_user_gpu_cap": 1,
        },
        PROJECTS[1],
    ]
    store.projects.apply_config(t(1), changed, PROFILES, PRIORITY_CLASSES)
    alice = ask(store, t(2), "alice")
    bob = ask(store, t(3), "bob", gpu_type="H100", gpus=2)
    cycle(store, t(4))
    # No A100 quota any more: no guarantee, but idle A100s may be borrowed.
    assert workload(store, alice).reason == (
        "admitted on a2 (zone-a); 1 borrowed beyond project vision's guarantee"
    )
    assert workload(store, bob).reason == (
        "More than project vision may ever hold; ask for fewer GPUs, or for a higher limit: "
        "needs 2 × H100, project vision may never hold more than 1 × H100 (guarantee plus "
        "borrow limit)"
    )


def test_apply_config_rejects_an_undeclared_parent_and_writes_nothing(
    store: FleetStore, engine: Engine
) -> None:
    before = row_counts(engine)
    with pytest.raises(InvalidRequest, match="names parent 'lab', which is not declared"):
        store.projects.apply_config(
            t(1), [{"name": "new", "parent": "lab"}], PROFILES, PRIORITY_CLASSES
        )
    assert row_counts(engine) == before


def test_mig_slices_are_gpu_types_of_their_own(engine: Engine) -> None:
    """A node with MIG slices offers them as their own type beside its whole GPUs."""
    store = FleetStore(engine, "controller-a")
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(
        T0,
        [
            {
                "name": "vision",
                "quotas": {"A100-80GB": {"guaranteed": 1}, "A100-80GB:1g.10gb": {"guaranteed": 7}},
            }
        ],
        [],
        [{"name": "standard", "rank": 200}],
    )
    slices = tuple(GpuSpec(f"MIG-{i}", i, gpu_type="A100-80GB:1g.10gb") for i in range(7))
    store.nodes.register_nodes(
        T0,
        "agent",
        [
            NodeSpec(
                "mig-node",
                "local",
                "zone-a",
                "A100-80GB",
                (*slices, GpuSpec("GPU-whole", 7)),
            )
        ],
    )
    store.projects.sync_memberships(T0, {"vision": ["alice"]})
    with store.read() as session:
        assert catalogue_of(session, "alice").largest_node == {
            "A100-80GB": 1,
            "A100-80GB:1g.10gb": 7,
        }
    lease = timedelta(seconds=30)
    small = store.workloads.open_session_request(
        T0, SessionRequest("alice", "s", "vision", "A100-80GB:1g.10gb", 3), lease
    )
    whole = store.workloads.open_session_request(
        T0, SessionRequest("alice", "w", "vision", "A100-80GB", 1), lease
    )
    cycle(store, T0)
    with store.read() as session:
        got = {
            w.id: sorted(a.gpu_uuid for a in w.allocations)
            for w in session.scalars(select(Workload))
        }
    assert got == {small.id: ["MIG-0", "MIG-1", "MIG-2"], whole.id: ["GPU-whole"]}


def test_a_lost_gpu_is_neither_free_nor_offered_and_its_loss_is_an_event(
    store: FleetStore,
) -> None:
    from gpufleet.hub.api.handlers import node_rows

    store.nodes.record_samples(t(1), "agent-1", [{"uuid": "GPU-h1-0", "index": 0, "lost": True}])
    assert events(store, "gpu-lost") == [
        "GPU GPU-h1-0 (index 0) on h1 is lost (NVML: fallen off the bus); it receives no new work"
    ]
    carol = ask(store, t(2), "carol", project="nlp", gpu_type="H100", gpus=2)
    cycle(store, t(2))
    assert workload(store, carol).state == WorkloadState.pending
    with store.read() as session:
        h1 = next(row for row in node_rows(session) if row.name == "h1")
    assert (h1.gpus, h1.free_gpus) == (2, 1)


# ------------------------------------------------------------------ the culler's rows
def running_session(store: FleetStore, username: str = "alice") -> int:
    workload_id = ask(store, t(1), username)
    cycle(store, t(2))
    store.workloads.mark_running(t(3), workload_id, {"paths": ["/home/alice"]})
    return workload_id


def test_a_busy_kernel_unmarks_an_idle_session_in_the_same_request(store: FleetStore) -> None:
    from gpufleet.state.sessions import ActivityReport

    wid = running_session(store)
    assert store.sessions.record_idle_decision(
        t(10), wid, "mark-idle", "idle for 60 min", last_active=t(3)
    )
    assert workload(store, wid).idle_since == t(3)
    quiet = ActivityReport(
        kernels=1, kernels_busy=False, kernel_activity=t(2), terminal_activity=None
    )
    store.sessions.record_activity(t(11), wid, "alice", quiet)
    assert workload(store, wid).idle_since == t(3)  # nothing new: still reclaimable
    busy = ActivityReport(
        kernels=1, kernels_busy=True, kernel_activity=t(12), terminal_activity=None
    )
    state = store.sessions.record_activity(t(12), wid, "alice", busy)
    assert workload(store, wid).idle_since is None
    assert state.notices == []  # the idle notice went with the mark
    assert events(store, "session-active-again") == ["in use again: a kernel is running code"]


def test_what_a_session_start_said_stays_beside_the_warnings_that_come_and_go(
    store: FleetStore,
) -> None:
    wid = running_session(store)
    store.sessions.post_session_notice(t(4), wid, "info", "restored from the snapshot of t(0)")

    def shown() -> list[str]:
        return [n["message"] for n in store.sessions.session_state(wid, "alice").notices]

    store.sessions.record_idle_decision(t(10), wid, "warn", "idle: stops in 10 s", due_at=t(20))
    assert shown() == ["Restored from the snapshot of t(0)", "Idle: stops in 10 s"]
    store.sessions.record_idle_decision(t(11), wid, "withdraw", "in use again")
    assert shown() == ["Restored from the snapshot of t(0)"]
    store.sessions.set_keep_alive(t(12), wid, "alice", t(30), timedelta(hours=1))
    assert shown() == ["Restored from the snapshot of t(0)"]


def test_a_report_for_someone_elses_session_finds_nothing(store: FleetStore) -> None:
    from gpufleet.scheduler.errors import NotFound
    from gpufleet.state.sessions import ActivityReport

    wid = running_session(store)
    report = ActivityReport(
        kernels=0, kernels_busy=False, kernel_activity=None, terminal_activity=None
    )
    with pytest.raises(NotFound, match=f"no running session {wid} of bob"):
        store.sessions.record_activity(t(5), wid, "bob", report)


def test_keep_alive_beyond_the_projects_limit_says_the_latest_allowed_time(
    store: FleetStore,
) -> None:
    wid = running_session(store)
    with pytest.raises(InvalidRequest) as refused:
        store.sessions.set_keep_alive(t(5), wid, "alice", t(5 + 9 * 3600), timedelta(hours=8))
    assert "its project allows at most 8 h ahead, so until 2026-01-05 17:00 UTC" in str(
        refused.value
    )
    assert store.sessions.set_keep_alive(t(5), wid, "alice", t(3605), timedelta(hours=8)) == t(3605)
    (row,) = store.sessions.culler_sessions()
    assert (row.keep_alive_until, row.snapshot_sources) == (t(3605), {"paths": ["/home/alice"]})


def test_the_culler_sees_when_a_gpu_of_the_session_last_worked(store: FleetStore) -> None:
    wid = running_session(store)
    (uuid,) = [u for w, u, closed in allocations(store) if w == wid and closed is None]
    sample = {"uuid": uuid, "index": 0, "at": 0.0}
    store.nodes.record_samples(t(20), "agent-1", [{**sample, "utilization_gpu_pct": 40}], 5.0)
    store.nodes.record_samples(t(30), "agent-1", [{**sample, "utilization_gpu_pct": 2}], 5.0)
    (row,) = store.sessions.culler_sessions()
    assert (row.workload_id, row.gpu_activity) == (wid, t(20))
