"""No researcher can take a node down: while bob's job runs, alice submits a job with each
hostile value of every field of the job spec. What the controller can check is refused at
submit (400, saying what to change); what only the node can find out ends her job alone, as
her error (not retried). The node agent stays up throughout, and bob's job runs on
untouched: same ranks, same attempt, no fault, still stepping.

Her ranks also try to pass for bob's: a progress report with bob's process marker is
refused by the agent (403), a checkpoint outside her job's location is left out, and bob's
job never resumes from her files."""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

import httpx
import pytest

from gpufleet.client import ApiError, Client
from gpufleet.recovery import processes

from .harness import Hub, wait_for
from .test_agent_restarts import STEPS_FOREVER

pytestmark = pytest.mark.integration

A100 = "A100-80GB"
RAW = "raw JSON: "  # a value sent as the JSON text that follows, as json.dumps cannot

# What the controller refuses at submit, field by field, with what its message says.
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"checkpoint_uri": "/etc"}, "checkpoint_uri /etc must be in"),
    ({"checkpoint_uri": "file:///etc/x"}, "only s3:// locations and local directories"),
    ({"checkpoint_uri": "/tmp/../etc"}, "without .. parts"),
    ({"checkpoint_uri": "s3:///x"}, "must be s3://<bucket>/<prefix>"),
    ({"env": {"A=B": "x"}}, "'A=B' is not a variable name"),
    ({"env": {"A": "x\0y"}}, "the value of A holds a NUL character"),
    ({"python": "/etc/passwd"}, "python /etc/passwd is not an executable file"),
    ({"python": "python3"}, "must be an absolute path"),
    ({"python": "/usr/bin/python3\0"}, "python holds a control character"),
    ({"cwd": "work"}, "cwd 'work' must be an absolute path"),
    ({"args": ["--lr", "1\0"]}, "args[1] holds a NUL character"),
    ({"script_name": "../../x.py"}, "script_name"),
    ({"script": ""}, "script"),
    ({"gpus": " 1"}, "send the digits alone, without spaces"),
    ({"gpus": True}, "must be a whole number such as 1 or 2, not true"),
    ({"gpus": RAW + "1e400"}, "must be a whole number such as 1 or 2"),
    ({"gpus_per_pod": 0}, "ask for at least 1 GPU (got 0)"),
    ({"gpu_type": "A100-80GB\u202e"}, "gpu_type"),
    ({"project": "vision-nonexistent"}, "vision-nonexistent"),
    ({"priority": "root"}, "root"),
    ({"session": 2**62}, "session"),
    ({"name": "x\nINFO forged log line"}, "name"),
]

WRITES_ERROR_FILE = (
    "with open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w') as f:\n"
    "    f.write({content})\n"
    "raise ValueError('hostile')\n"
)

# What only the node finds out: each ends her job as her error, never retried.
NODE_FAILS: list[tuple[dict[str, Any], str]] = [
    ({"python": "/nonexistent/bin/python"}, "exited with code 127"),
    (
        {"checkpoint_uri": "s3://ckpt/alice/x"},
        " could not start: the job checkpoints to s3://ckpt/alice/x, but this node has no S3 "
        "checkpoint credentials for alice",
    ),
    # Its script tries to kill the agent: not a process its sandbox even shows.
    (
        {"script": "import os, signal\nos.kill(int(os.environ['AGENT_PID']), signal.SIGKILL)\n"},
        "ProcessLookupError",
    ),
    # What it leaves for the agent to read: an error file nested deeper than JSON is
    # read, and one whose message fakes torchrun's summary with a rank number no int()
    # takes. The agent reads past both to the rank's own last line.
    ({"script": "import os\n" + WRITES_ERROR_FILE.format(content="'[' * 100_000")}, "hostile"),
    (
        {
            "script": "import json, os\n"
            + WRITES_ERROR_FILE.format(
                content="json.dumps({'message': {'message': 'Root Cause\\nrank : ' + "
                "'9' * 5000 + ' (local_rank: 0)'}})"
            )
        },
        "hostile",
    ),
]


def body(**fields: Any) -> dict[str, Any]:
    return {
        "project": "nlp",
        "gpu_type": A100,
        "gpus": 1,
        "name": "hostile",
        "script": "print('hello')\n",
        **fields,
    }


def _job(hub: Hub, job_id: int) -> dict[str, Any]:
    answer: dict[str, Any] = hub.controller("GET", f"/jobs/{job_id}").json()
    return answer


def _step(hub: Hub, job_id: int) -> int:
    progress = _job(hub, job_id)["progress"]
    return -1 if not progress or progress["last_step"] is None else int(progress["last_step"])


def _marker_of(job_id: int) -> str:
    """The process marker of the job's pod 0 (as root reads it from /proc)."""
    for found in processes.marked_process_details(("GPUFLEET_JOB_ID", "GPUFLEET_POD_INDEX")):
        if found.environ == {"GPUFLEET_JOB_ID": str(job_id), "GPUFLEET_POD_INDEX": "0"}:
            return found.marker
    raise AssertionError(f"no process of job {job_id}'s pod 0")


# Alice's rank reports as bob's pod (his marker: refused), then a checkpoint outside her
# job's location (left out, and the answer says so), then her own step; it prints each
# answer's status and text.
PASSES_FOR_BOB = textwrap.dedent(
    """
    import json, os, urllib.error, urllib.request

    def post(marker, report):
        request = urllib.request.Request(
            os.environ["GPUFLEET_PROGRESS_URL"], data=json.dumps(report).encode(),
            headers={"X-Gpufleet-Marker": marker, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    if os.environ["LOCAL_RANK"] == "0":
        mine = os.environ["GPUFLEET_SESSION_MARKER"]
        outside = "/tmp/alice-checkpoint"
        saved = {"checkpoints_saved": [{"uri": outside, "step": 10**6, "age_s": 0}]}
        print("as bob:", *post(os.environ["BOB_MARKER"], saved), flush=True)
        print("outside:", *post(mine, saved), flush=True)
        print("own:", *post(mine, {"step": 3}), flush=True)
    """
)


def test_a_hostile_job_ends_alone_and_another_users_job_on_the_node_runs_on(fleet: Hub) -> None:
    hub = fleet
    bob = Client(hub.controller_api, hub.user_token("bob"))
    alice = Client(hub.controller_api, hub.user_token("alice"))
    with bob, alice:
        # Everything on one node (one zone): bob's job, and each of alice's beside it.
        hub.controller("POST", "/nodes/gpu-node-b/cordon")
        bobs = bob.submit(
            STEPS_FOREVER,
            gpus=2,
            gpus_per_pod=1,
            gpu_type=A100,
            project="vision",
            name="bobs",
            env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"},
        ).id
        wait_for(lambda: _step(hub, bobs) >= 3, 180, "bob's job stepping")
        agent = hub.service_pid("gpufleet-agent")
        bobs_marker = processes.workload_marker(_marker_of(bobs))
        ranks = {pid: processes.start_ticks(pid) for pid in processes.marked_pids(bobs_marker)}
        assert agent is not None and ranks

        token = hub.user_token("alice")
        wrong = []
        for fields, expected in REFUSED:
            answer = httpx.post(
                f"{hub.controller_api}/jobs",
                content=re.sub(f'"{RAW}([^"]*)"', r"\1", json.dumps(body(**fields))),
                headers={"Authorization": f"token {token}"},
                timeout=30,
            )
            if answer.status_code not in (400, 404) or expected not in answer.text:
                wrong.append((fields, answer.status_code, answer.text))
        assert not wrong, "\n".join(map(str, wrong))

        failing = []
        for fields, _ in NODE_FAILS:
            env = {"AGENT_PID": str(agent)}
            failing.append(alice.submit(**{**body(env=env), **fields}).id)
        for job_id, (fields, expected) in zip(failing, NODE_FAILS, strict=True):
            ended = alice.wait(job_id, timeout=180)
            assert (ended.outcome, ended.attempt, ended.faults) == ("failed", 1, 0), (
                fields,
                ended.reason,
            )
            assert expected in ended.reason, (fields, ended.reason)
            assert {p.node for p in ended.pod_states} == {"gpu-node-a"}

        # Her rank passes for bob's pod: refused, whatever marker it shows.
        posing = alice.submit(
            **body(script=PASSES_FOR_BOB, env={"BOB_MARKER": _marker_of(bobs)})
        ).id
        done = alice.wait(posing, timeout=180)
        assert done.outcome == "succeeded", done.reason
        said = "".join(alice.logs(posing, rank=0))
        assert "as bob: 403 403: the report does not come from the account" in said, said
        assert (
            "outside: 200 checkpoint /tmp/alice-checkpoint is left out: it is not inside" in said
        ), said
        assert "own: 204" in said, said

        # The agent never went down, and bob's job never noticed.
        assert hub.service_pid("gpufleet-agent") == agent
        job = _job(hub, bobs)
        assert (job["state"], job["attempt"], job["faults"]) == ("running", 1, 0), job["reason"]
        assert all(processes.running(pid, start or 0) for pid, start in ranks.items())
        last = job["progress"]["last_checkpoint"]
        assert last is None or "alice" not in last["uri"]
        before = _step(hub, bobs)
        wait_for(lambda: _step(hub, bobs) >= before + 5, 60, "bob's job stepping on")
        with pytest.raises(ApiError):
            alice.cancel(bobs)  # and she cannot touch it through the API either
