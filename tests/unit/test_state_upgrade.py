"""A database the previous release made, with its rows, upgrades in place (SQLite and
PostgreSQL: ``empty_engine`` runs both) and reads back through today's store.

The rows are written with plain SQL against the schema that release's migrations built
(reflected from the database, never today's models), as that release wrote them: naive
UTC timestamps, ids given by the database. Then the upgrade an operator runs
(``gpufleet-controller upgrade-db``: ``db.upgrade``), a restarted controller (config
applied again, its agent registering the same node), and what a user would look for: the
running session keeps its GPUs, an admin's quota edit still caps the queue, the ended
job's attempts, progress, logs and usage, the snapshots, the culler's keep-alive, the
Unix account.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, insert, select

from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import SessionRequest
from gpufleet.state import db
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec
from gpufleet.state.models import Allocation, Event, JobProgress, Workload
from gpufleet.state.progress import progress_json

# The head revision of the release before the database moved to its own folder (state/):
# the schema a database in the field may be at when this version is installed over it.
PREVIOUS_RELEASE_HEAD = "0021"

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)  # when the previous release last wrote
NOW = T0 + timedelta(minutes=30)  # the upgraded controller's first cycle


def naive(moment: datetime) -> datetime:
    """How the previous release stored a time: naive UTC."""
    return moment.astimezone(UTC).replace(tzinfo=None)


def ago(**delta: float) -> datetime:
    return naive(T0 - timedelta(**delta))


class PreviousRelease:
    """Writes rows as the previous release did, into the tables its migrations made."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.tables = MetaData()
        self.tables.reflect(connection)

    def add(self, table: str, **values: Any) -> Any:
        result = self.connection.execute(insert(self.tables.tables[table]).values(**values))
        key = result.inserted_primary_key
        assert key is not None
        return key[0]


def seed(old: PreviousRelease) -> dict[str, int]:
    """Projects with an admin's quota edit, one node of 4 A100, alice's running session on
    two of them, carol's job that succeeded on its second attempt (the first lost to a
    GPU fault), their events, a snapshot, activity and accounts; the ids it made."""
    old.add(
        "priority_classes",
        name="standard",
        rank=100,
        preemptible_by_default=False,
        description="",
    )
    lab = old.add(
        "projects",
        name="lab",
        display_name="Lab",
        kind="organisation",
        default_priority="standard",
        allowed_priorities=[],
        fair_share_weight=1.0,
    )
    vision, nlp = (
        old.add(
            "projects",
            name=name,
            display_name=name.title(),
            kind="project",
            parent_id=lab,
            hub_group=name,
            default_priority="standard",
            allowed_priorities=[],
            fair_share_weight=1.0,
        )
        for name in ("vision", "nlp")
    )
    # The config says 2; an admin raised it to 3 in the panel, which the config must not undo.
    old.add(
        "project_quotas",
        project_id=vision,
        gpu_type="A100",
        guaranteed=3,
        borrow_limit=0,
        edited_by="admin",
        edited_at=ago(days=1),
    )
    old.add("project_quotas", project_id=nlp, gpu_type="A100", guaranteed=4)
    for project, user in ((vision, "alice"), (vision, "bob"), (nlp, "carol")):
        old.add("memberships", project_id=project, username=user, source="hub-group")
    old.add(
        "profiles",
        name="pytorch",
        display_name="PyTorch",
        description="",
        environment="",
        cpu_per_gpu=4.0,
        memory_per_gpu_bytes=32 * 2**30,
        allowed_gpu_types=[],
        allowed_projects=[],
        is_default=True,
    )
    cluster = old.add("clusters", name="local", backend="local")
    zone = old.add("zones", cluster_id=cluster, name="zone-a")
    node = old.add(
        "nodes",
        name="a1",
        zone_id=zone,
        gpu_type="A100",
        cpus=64.0,
        memory_bytes=512 * 2**30,
        labels={},
        health="ok",
        cordoned=False,
        last_heartbeat_at=ago(seconds=5),
        agent="agent-1",
    )
    for index in range(4):
        old.add(
            "gpus",
            uuid=f"GPU-a1-{index}",
            node_id=node,
            index=index,
            gpu_type="A100",
            pci_bus_id=f"0000:0{index}:00.0",
            memory_bytes=80 * 2**30,
            present=True,
        )
    session = old.add(
        "workloads",
        kind="session",
        project_id=vision,
        username="alice",
        server_name="",
        name="",
        profile="pytorch",
        gpu_type="A100",
        pods=1,
        gpus_per_pod=2,
        priority_class="standard",
        preemptible=False,
        state="running",
        reason="admitted on a1 (zone-a)",
        version=3,
        created_at=ago(hours=3),
        admitted_at=ago(hours=3),
        started_at=ago(hours=3),
        process_marker="marker-alice",
        snapshot_sources={"paths": ["/home/alice"], "prefixes": [], "exclude": []},
    )
    job = old.add(
        "workloads",
        kind="job",
        project_id=nlp,
        username="carol",
        server_name="",
        name="train",
        gpu_type="A100",
        pods=1,
        gpus_per_pod=1,
        priority_class="standard",
        preemptible=False,
        state="ended",
        outcome="succeeded",
        reason="every rank exited 0",
        version=9,
        created_at=ago(hours=5),
        admitted_at=ago(hours=4),
        started_at=ago(hours=4),
        ended_at=ago(hours=1),
        spec={"script": "train()", "script_name": "train.py", "args": ["--epochs", "10"]},
        attempt=2,
        faults=1,
        recovery={"avoid_gpus": ["GPU-a1-3"], "trained_since": ago(hours=5).isoformat()},
    )
    for gpu in ("GPU-a1-0", "GPU-a1-1"):
        old.add(
            "allocations",
            workload_id=session,
            gpu_uuid=gpu,
            node_id=node,
            pod_index=0,
            project_id=vision,
            username="alice",
            gpu_type="A100",
            opened_at=ago(hours=3),
        )
    for gpu, opened, closed in (("GPU-a1-3", 5, 4), ("GPU-a1-2", 4, 1)):  # one per attempt
        old.add(
            "allocations",
            workload_id=job,
            gpu_uuid=gpu,
            node_id=node,
            pod_index=0,
            project_id=nlp,
            username="carol",
            gpu_type="A100",
            opened_at=ago(hours=opened),
            closed_at=ago(hours=closed),
        )
    old.add(
        "job_pods",
        workload_id=job,
        pod_index=0,
        node="a1",
        state="exited",
        exit_code=0,
        reason="",
        started_at=ago(hours=4),
        ended_at=ago(hours=1),
    )
    old.add(
        "job_progress",
        workload_id=job,
        last_step=5000,
        last_epoch=9,
        last_step_at=ago(hours=1, minutes=1),
        step_times=[0.5, 0.5, 0.6],
        metrics={"loss": 0.25},
        history={"every_s": 60, "points": [[ago(hours=2).timestamp(), 4000, 8, 0.3]]},
        last_checkpoint_uri="/ckpt/carol/train/step-5000",
        last_checkpoint_step=5000,
        last_checkpoint_epoch=9,
        last_checkpoint_at=ago(hours=1, minutes=2),
        checkpoints_saved={"1": 3, "2": 2},
        updated_at=ago(hours=1),
    )
    old.add(
        "job_logs",
        workload_id=job,
        rank=0,
        stream="stdout",
        offset=0,
        data="epoch 9 done\n",
        at=ago(hours=1),
    )
    for at, kind, workload, data in (
        (ago(hours=3), "admitted", session, {}),
        (ago(hours=4, minutes=30), "job-fault", job, {"xid": 79, "gpu": "GPU-a1-3"}),
        (ago(hours=4, minutes=1), "job-restarting", job, {"attempt": 2}),
        (ago(hours=1), "ended", job, {"outcome": "succeeded"}),
    ):
        old.add(
            "events",
            at=at,
            kind=kind,
            message=f"{kind} of workload {workload}",
            reason="",
            cause="",
            workload_id=workload,
            project="vision" if workload == session else "nlp",
            username="alice" if workload == session else "carol",
            data=data,
        )
    old.add(
        "snapshots",
        username="alice",
        server_name="",
        project_id=vision,
        workload_id=session,
        store_uri="file:///srv/gpufleet/snapshots",
        manifest_key="manifests/alice/default/20260105T080000Z",
        created_at=ago(hours=1),
        size_bytes=5 * 2**30,
        file_count=1234,
    )
    old.add(
        "session_activity",
        workload_id=session,
        reported_at=ago(minutes=1),
        kernels_busy=False,
        kernels=1,
        user_activity=ago(minutes=10),
        user_action="input",
        keep_alive_until=naive(T0 + timedelta(hours=2)),
    )
    old.add(
        "user_accounts",
        username="alice",
        uid=200_007,
        gid=200_007,
        mode="sandbox",
        created_at=ago(days=30),
    )
    return {"session": session, "job": job}


# What the restarted controller's config declares: vision's A100 guarantee is 2 there.
PROJECTS: list[dict[str, Any]] = [
    {"name": "lab", "kind": "organisation"},
    {
        "name": "vision",
        "parent": "lab",
        "hub_group": "vision",
        "quotas": {"A100": {"guaranteed": 2, "borrow_limit": 0}},
    },
    {"name": "nlp", "parent": "lab", "hub_group": "nlp", "quotas": {"A100": {"guaranteed": 4}}},
]
NODE = NodeSpec(
    name="a1",
    cluster="local",
    zone="zone-a",
    gpu_type="A100",
    gpus=tuple(GpuSpec(f"GPU-a1-{i}", i) for i in range(4)),
)


def test_a_database_of_the_previous_release_upgrades_in_place_with_its_rows(
    empty_engine: Engine,
) -> None:
    db.upgrade(empty_engine, PREVIOUS_RELEASE_HEAD)
    with empty_engine.begin() as connection:
        ids = seed(PreviousRelease(connection))
    session, job = ids["session"], ids["job"]

    db.upgrade(empty_engine)  # what `gpufleet-controller upgrade-db` runs
    db.check_schema(empty_engine)  # the controller starts on it

    store = FleetStore(empty_engine, "controller-b", lease_ttl=timedelta(seconds=15))
    assert store.try_acquire_lease(NOW)
    store.projects.apply_config(NOW, PROJECTS, [{"name": "pytorch", "default": True}], [])
    assert store.nodes.register_nodes(NOW, "agent-1", [NODE]) == ["a1"]

    # Alice's running session keeps both its GPUs and counts against vision's quota, whose
    # guarantee is still the admin's 3, not the config's 2: bob's one GPU is admitted on a
    # GPU she does not hold; alice's second server waits.
    bob = store.workloads.open_session_request(
        NOW, SessionRequest("bob", "", "vision", "A100", 1, None), timedelta(seconds=30)
    ).id
    alice_again = store.workloads.open_session_request(
        NOW, SessionRequest("alice", "second", "vision", "A100", 1, None), timedelta(seconds=30)
    ).id
    result = store.scheduling.scheduling_cycle(NOW + timedelta(seconds=1), Policy())
    assert [admitted.workload_id for admitted in result.admitted] == [bob]
    with store.read() as read:
        open_gpus = dict(
            read.execute(
                select(Allocation.gpu_uuid, Allocation.workload_id).where(
                    Allocation.closed_at.is_(None)
                )
            ).all()
        )
        waiting = read.get_one(Workload, alice_again)
        running = read.get_one(Workload, session)
    assert open_gpus["GPU-a1-0"] == open_gpus["GPU-a1-1"] == session
    (bobs,) = [gpu for gpu, owner in open_gpus.items() if owner == bob]
    assert bobs in {"GPU-a1-2", "GPU-a1-3"}
    assert (running.state, running.started_at) == ("running", T0 - timedelta(hours=3))
    assert "project vision uses 3/3 guaranteed A100 and may borrow 0 more" in waiting.reason

    # The culler still honours alice's keep-alive; her account keeps its uid.
    state = store.sessions.session_state(session, "alice")
    assert (state.keep_alive_until, state.project, state.profile) == (
        T0 + timedelta(hours=2),
        "vision",
        "pytorch",
    )
    assert store.accounts.account(NOW, "alice").uid == 200_007

    # Her snapshot is still listed, with its size, for a restore.
    (snapshot,) = store.snapshots.snapshots_of("alice")
    assert (snapshot.manifest_key, snapshot.size_bytes, snapshot.file_count) == (
        "manifests/alice/default/20260105T080000Z",
        5 * 2**30,
        1234,
    )

    # Carol's job: how it ended, its two attempts (one GPU each, both closed: her usage),
    # its progress and checkpoints by attempt, its events and its log.
    with store.read() as read:
        ended = read.get_one(Workload, job)
        progress = progress_json(read.get_one(JobProgress, job))
        spans = read.execute(
            select(Allocation.gpu_uuid, Allocation.opened_at, Allocation.closed_at)
            .where(Allocation.workload_id == job)
            .order_by(Allocation.id)
        ).all()
        kinds = list(
            read.scalars(select(Event.kind).where(Event.workload_id == job).order_by(Event.at))
        )
    assert (ended.state, ended.outcome, ended.attempt, ended.faults) == ("ended", "succeeded", 2, 1)
    assert ended.recovery is not None and ended.recovery["avoid_gpus"] == ["GPU-a1-3"]
    assert [tuple(span) for span in spans] == [
        ("GPU-a1-3", T0 - timedelta(hours=5), T0 - timedelta(hours=4)),
        ("GPU-a1-2", T0 - timedelta(hours=4), T0 - timedelta(hours=1)),
    ]
    assert progress["last_checkpoint"]["uri"] == "/ckpt/carol/train/step-5000"
    assert progress["checkpoints_saved_by_attempt"] == {1: 3, 2: 2}
    assert (progress["last_step"], progress["metrics"]) == (5000, {"loss": 0.25})
    assert kinds == ["job-fault", "job-restarting", "ended"]
    assert store.jobs.read_log(job, 0, "stdout", 0, 1024).data == "epoch 9 done\n"
