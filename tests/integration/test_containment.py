"""A hostile researcher, from inside a session (a kernel of their own server) and from a
job's rank: every attempt to reach the platform or another researcher is denied.

One hub; alice and bob each run a session. The same probe script (``PROBE``) runs in
alice's kernel and as alice's job's entry script; it tries each attack and reports
``denied: <how>`` or ``ALLOWED: <what it got>`` per attempt, and the tests assert that every
attempt was denied. A second job tries to make the agent, which runs as root, read a secret
for it through a symbolic link in place of its log.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.client import ApiError, Client
from gpufleet.snapshotter.sandbox import default_session_env

from ..s3server import S3Server
from .harness import REPO, Hub, pids_with_env, run_in_kernel, wait_for

pytestmark = pytest.mark.integration

PROBE = textwrap.dedent(
    r'''
    import json, os, socket, struct, subprocess, urllib.error, urllib.request


    def attempt(results, name, action):
        """Run ``action``; what it returns is what it got (the attack worked)."""
        try:
            got = action()
        except (OSError, urllib.error.URLError, subprocess.SubprocessError, ValueError) as e:
            results[name] = f"denied: {type(e).__name__}: {e}"[:300]
            return
        results[name] = "denied: " + got[7:] if str(got).startswith("denied:") else (
            f"ALLOWED: {str(got)[:300]}"
        )


    def read(path):
        with open(path, "rb") as f:
            return f.read(64)


    def write(path):
        with open(path, "ab") as f:
            f.write(b"x")
        return f"wrote {path}"


    def http(method, url, token=None, body=None):
        request = urllib.request.Request(url, method=method, data=body)
        if token:
            request.add_header("Authorization", f"token {token}")
        if body is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.read(4096).decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, ""


    def refused(status, text, *, allowed_body=None):
        if status in (401, 403, 404) or (allowed_body is not None and allowed_body(text)):
            return f"denied: HTTP {status}"
        return f"HTTP {status}: {text[:200]}"


    def postgres_without_password(port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            params = b"user\0postgres\0database\0postgres\0\0"
            s.sendall(struct.pack("!II", 8 + len(params), 196608) + params)
            kind = s.recv(1)
            length = struct.unpack("!I", s.recv(4))[0]
            body = s.recv(length - 4)
        if kind == b"R" and struct.unpack("!I", body[:4])[0] != 0:
            return "denied: the server asks for a password"
        return f"answered {kind!r} {body[:20]!r}"


    def run(t):
        results = {}
        for name, path in t["secrets"].items():
            attempt(results, f"read {name}", lambda p=path: read(p))
        for name, path in t["platform_files"].items():
            attempt(results, f"write {name}", lambda p=path: write(p))
        attempt(results, "list bob's home", lambda: os.listdir(t["bob_home"]))
        attempt(results, "write bob's home", lambda: write(os.path.join(t["bob_home"], "x")))
        attempt(results, "signal bob's server", lambda: os.kill(t["bob_pid"], 0) or "signalled")
        attempt(
            results,
            "see other users' processes",
            lambda: (
                [
                    p for p in os.listdir("/proc") if p.isdigit() and p != "1"  # its init
                    and os.stat(f"/proc/{p}").st_uid != os.getuid()
                ] or "denied: only its own processes are visible"
            ),
        )
        token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        api = t["controller_api"]
        node = json.dumps({"nodes": [{"name": "evil", "zone": "z", "gpus": []}]}).encode()
        attempt(
            results, "post inventory as an agent",
            lambda: refused(*http("POST", f"{api}/agent/register", token, node)),
        )
        attempt(
            results, "sync pods as an agent",
            lambda: refused(*http("POST", f"{api}/agent/pods", token, b'{"nodes": []}')),
        )
        for what in ("workloads", "snapshots", "events"):
            attempt(
                results, f"list bob's {what}",
                lambda w=what: refused(
                    *http("GET", f"{api}/{w}?username=bob", token),
                    allowed_body=lambda text: '"bob"' not in text,
                ),
            )
        attempt(
            results, "bob's server without his token",
            lambda: refused(
                *http("GET", f"http://127.0.0.1:{t['bob_port']}/user/bob/api/contents", token),
            ),
        )
        if t.get("postgres_port"):
            attempt(
                results, "PostgreSQL without its password",
                lambda: postgres_without_password(t["postgres_port"]),
            )
        for name, port in t["ports"].items():
            def connect(port=port):
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    return f"connected to {port}"
            attempt(results, f"connect to {name}", connect)
        attempt(results, "write the fake NVML control file", lambda: write(t["nvml_control"]))

        def escalate():
            with open("/proc/self/status") as f:
                if "NoNewPrivs:\t1" not in f.read():
                    return "setuid programs can gain privileges here"
            done = subprocess.run(
                ["su", "root", "-c", "id -u"], capture_output=True, text=True, timeout=20,
                stdin=subprocess.DEVNULL,
            )
            if done.returncode == 0:
                return f"su answered {done.stdout!r}"
            os.setuid(0)
            return "became root"

        attempt(results, "escalate through setuid programs", escalate)
        attempt(results, "run as root", lambda: os.getuid() and f"denied: uid {os.getuid()}")
        return results
    '''
)


@pytest.fixture(scope="module")
def contained(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Hub]:
    # The S3 server's ports do not all authenticate (master, volume, filer): the agent's
    # loopback guard keeps them for the platform.
    ports = sorted(set(s3_server.ports.values()))
    hub = Hub.create(
        Path(tmp_path_factory.mktemp("containment")),
        extra_config=f"c.NodeAgent.protected_ports = {ports!r}\n",
    )
    hub.start()
    try:
        yield hub
    finally:
        hub.kill_everything()


@pytest.fixture(scope="module")
def targets(contained: Hub, request: pytest.FixtureRequest) -> dict[str, Any]:
    hub = contained
    hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=1)
    hub.start_session("bob", project="vision", gpu_type="A100-80GB", gpus=1)
    user = hub.hub_api("GET", "/users/bob", params={"include_stopped_servers": "1"}).json()
    marker = user["servers"][""]["state"]["gpufleet_marker"]
    bob_pid, bob_port = _server_of(marker)
    data = hub.data_dir
    # bob's job, waiting at its rendezvous (torch's TCPStore answers whoever connects).
    with Client(hub.controller_api, hub.user_token("bob")) as client:
        job = client.submit(
            "import time\ntime.sleep(600)\n",
            gpus=1, gpu_type="A100-80GB", project="vision", name="bobs-rendezvous",
        )  # fmt: skip
    rendezvous = wait_for(lambda: _rendezvous_port(job.id), 60, "bob's job at its rendezvous")
    s3 = request.getfixturevalue("s3_server")
    found: dict[str, Any] = {
        "secrets": {
            "the spawner's token": str(data / "spawner-token"),
            "the snapshot master key": str(data / "snapshot-master.key"),
            "JupyterHub's cookie secret": str(data / "jupyterhub_cookie_secret"),
            "the controller's database": str(data / "gpufleet.sqlite"),
            "JupyterHub's database": str(data / "jupyterhub.sqlite"),
            "the agent's jobs": str(data / "agent" / "jobs" / "launchers"),
        },
        "platform_files": {
            "the hub's environment": str(
                Path(sys.prefix) / "lib" / "python3.11" / "site-packages" / "gpufleet_evil.py"
            ),
            "the hub's checkout": str(REPO / "hub" / "app.py"),
            "the sessions' base environment": str(
                Path(default_session_env()) / "lib/python3.11/site-packages/gpufleet_evil.py"
            ),
        },
        "bob_home": str(data / "homes" / "bob"),
        "bob_pid": bob_pid,
        "bob_port": bob_port,
        "controller_api": hub.controller_api.replace(hub.url, f"http://127.0.0.1:{hub.base_port}"),
        "nvml_control": str(hub.fake_nvml_control),
        "ports": {
            **{f"the S3 server's {name} port": port for name, port in s3.ports.items()},
            "the agent's metrics": hub.base_port + 4,
            "bob's job's rendezvous": rendezvous,
        },
    }
    postgres = request.getfixturevalue("postgres_server") if _postgres_wanted() else None
    if postgres is not None:
        found["postgres_port"] = postgres.port
    return found


def _rendezvous_port(job_id: int) -> int | None:
    """The port torchrun of job ``job_id`` listens on for its rendezvous, once it does."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" in argv and f"GPUFLEET_JOB_ID={job_id}".encode() in env:
            ports = [a for a in argv if a.startswith(b"--master-port=")]
            if ports:
                port = int(ports[0].split(b"=")[1])
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        return port
    return None


def _postgres_wanted() -> bool:
    from ..postgres import skip_requested

    return not skip_requested()


def _server_of(marker: str) -> tuple[int, int]:
    """The host pid of the session's notebook server (of the processes with ``marker``,
    the one listening on TCP), and its port."""
    for pid in pids_with_env("GPUFLEET_SESSION_MARKER", marker):
        inodes = set()
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = str(fd.readlink())
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
            table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in table:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                return pid, int(fields[1].split(":")[1], 16)
    raise AssertionError(f"no process of the session {marker} listens on TCP")


def _denied(results: dict[str, str]) -> None:
    allowed = {name: what for name, what in results.items() if not what.startswith("denied")}
    assert allowed == {}, json.dumps(allowed, indent=2)


def test_a_session_reaches_nothing_of_the_platform_or_of_another_researcher(
    contained: Hub, targets: dict[str, Any]
) -> None:
    code = PROBE + f"\nimport json\nprint(json.dumps(run({json.dumps(targets)})))\n"
    output = run_in_kernel(contained, "alice", "", code, contained.user_token("alice"))
    results = json.loads(output)
    assert len(results) >= 30
    _denied(results)


def test_a_jobs_rank_reaches_nothing_of_the_platform_or_of_another_researcher(
    contained: Hub, targets: dict[str, Any]
) -> None:
    script = PROBE + (
        "\nimport json, os\n"
        "if os.environ.get('RANK') == '0':\n"
        "    print('PROBE ' + json.dumps(run(json.loads(os.environ['PROBE_TARGETS']))))\n"
    )
    with Client(contained.controller_api, contained.user_token("alice")) as alice:
        job = alice.submit(
            script,
            gpus=1,
            gpu_type="A100-80GB",
            project="vision",
            name="hostile",
            env={"PROBE_TARGETS": json.dumps(targets)},
        )
        ended = alice.wait(job.id, timeout=180)
        output = "".join(alice.logs(job.id, rank=0))
    assert ended.outcome == "succeeded", f"{ended.reason}\n{output}"
    line = next(row for row in output.splitlines() if row.startswith("PROBE "))
    results = json.loads(line[len("PROBE ") :])
    assert len(results) >= 30
    _denied(results)


def test_the_agent_does_not_read_a_secret_through_a_rank_s_symlinked_log(
    contained: Hub, targets: dict[str, Any]
) -> None:
    secret = (contained.data_dir / "snapshot-master.key").read_text().strip()
    script = textwrap.dedent(
        f"""
        import os, pathlib, sys, time
        # torchrun sends this rank's output to a file it opened in the pod's log directory:
        # put a link to the master key in its place, and in place of its directory too.
        out = pathlib.Path(os.readlink("/proc/self/fd/1"))
        out.unlink()
        out.symlink_to({targets["secrets"]["the snapshot master key"]!r})
        attempt = out.parent
        attempt.rename(attempt.with_name(attempt.name + "-moved"))
        attempt.mkdir()
        (attempt / "stdout.log").symlink_to({targets["secrets"]["the snapshot master key"]!r})
        (attempt / "stderr.log").symlink_to({targets["secrets"]["the spawner's token"]!r})
        print("linked", flush=True)
        sys.exit(3)
        """
    )
    with Client(contained.controller_api, contained.user_token("alice")) as alice:
        job = alice.submit(script, gpus=1, gpu_type="A100-80GB", project="vision", name="links")
        ended = alice.wait(job.id, timeout=180)
        logs = "".join(
            "".join(alice.logs(job.id, rank=rank, stream=stream))
            for rank in (0, -1)
            for stream in ("stdout", "stderr")
        )
    assert ended.outcome == "failed"
    assert secret not in logs and secret not in ended.reason
    token = (contained.data_dir / "spawner-token").read_text().strip()
    assert token not in logs and token not in ended.reason


def _wheel(directory: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module ``name`` (``VALUE = 42``)."""
    files = {
        f"{name}.py": b"VALUE = 42\n",
        f"{name}-1.0.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
        ),
        f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: gpufleet-tests\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{name}-1.0.dist-info/RECORD"] = (
        "\n".join([*record, f"{name}-1.0.dist-info/RECORD,,"]) + "\n"
    ).encode()
    wheel = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    wheel.chmod(0o644)
    return wheel


def test_pip_installs_into_the_sessions_own_environment_and_nobody_elses(
    contained: Hub, targets: dict[str, Any]
) -> None:
    name = f"gpufleet_probe_{uuid.uuid4().hex[:8]}"
    home = contained.data_dir / "homes" / "alice"
    wheel = _wheel(home, name)
    installed = json.loads(
        run_in_kernel(
            contained,
            "alice",
            "",
            textwrap.dedent(
                f"""
                import json, os, pwd, shutil, subprocess, sys
                done = subprocess.run(
                    [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                     {str(wheel)!r}], capture_output=True, text=True)
                import {name}
                print(json.dumps({{
                    "pip": done.returncode, "err": done.stderr[-500:], "where": {name}.__file__,
                    "value": {name}.VALUE, "python": shutil.which("python"),
                    "gpufleet": shutil.which("gpufleet"), "pip_cmd": shutil.which("pip"),
                    "name": pwd.getpwuid(os.getuid()).pw_name,
                }}))
                """
            ),
            contained.user_token("alice"),
        )
    )
    assert installed["pip"] == 0, installed["err"]
    assert installed["name"] == "alice"  # the sandbox's passwd has an entry for its uid
    assert installed["value"] == 42
    assert installed["where"].startswith("/opt/gpufleet/env/lib/")
    # A terminal of the session finds the session's Python, pip and the gpufleet command.
    assert installed["python"] == "/opt/gpufleet/env/bin/python"
    assert installed["pip_cmd"] == "/opt/gpufleet/env/bin/pip"
    assert installed["gpufleet"] == str(Path(default_session_env()) / "bin" / "gpufleet")
    # On the host, only alice's own upper directory holds it; bob's session has no such module.
    assert not Path(installed["where"]).exists()
    upper = contained.data_dir / "sessions" / "alice" / "default" / "upper"
    assert (upper / installed["where"].lstrip("/")).exists()
    elsewhere = run_in_kernel(
        contained,
        "bob",
        "",
        f"import importlib.util; print(importlib.util.find_spec({name!r}) is None)",
        contained.user_token("bob"),
    )
    assert elsewhere.strip() == "True"


def test_a_job_from_a_session_runs_in_that_sessions_environment_as_it_was_at_submit(
    contained: Hub, targets: dict[str, Any]
) -> None:
    name = f"gpufleet_pinned_{uuid.uuid4().hex[:8]}"
    wheel = _wheel(contained.data_dir / "homes" / "alice", name)
    script = f"import {name}, sys\nprint('value', {name}.VALUE, sys.prefix)\n"
    answer = run_in_kernel(
        contained,
        "alice",
        "",
        textwrap.dedent(
            f"""
            import subprocess, sys
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                            "--no-deps", {str(wheel)!r}], check=True)
            import importlib, pathlib
            from gpufleet.client import Client
            with Client() as fleet:
                job = fleet.submit({script!r}, gpus=1, gpu_type="A100-80GB", project="vision",
                                   name="from-the-session")
                # Changed right after the submission: the job keeps what was there then.
                module = pathlib.Path(importlib.import_module({name!r}).__file__)
                module.write_text("VALUE = 7\\n")
                job = fleet.wait(job, timeout=180)
                print(job.outcome, "".join(fleet.logs(job, rank=0)))
            """
        ),
        contained.user_token("alice"),
    )
    assert answer.startswith("succeeded"), answer
    assert "value 42 /opt/gpufleet/env" in answer


PRELOAD = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/preload-%d-%d", MARKS, (int)getpid(), (int)getuid());
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
}
"""


def test_what_a_submission_preloads_runs_only_as_its_user(
    contained: Hub, targets: dict[str, Any], tmp_path: Path
) -> None:
    home = contained.data_dir / "homes" / "alice"
    marks = home / f"marks-{uuid.uuid4().hex[:8]}"
    marks.mkdir()
    uid = marks.parent.stat().st_uid
    os.chown(marks, uid, uid)
    source = tmp_path / "preload.c"
    source.write_text(f'#define MARKS "{marks}"\n' + PRELOAD)
    library = home / f"preload-{uuid.uuid4().hex[:8]}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    library.chmod(0o755)
    with Client(contained.controller_api, contained.user_token("alice")) as alice:
        job = alice.submit(
            "print('ran')\n",
            gpus=1,
            gpu_type="A100-80GB",
            project="vision",
            name="preloaded",
            env={"LD_PRELOAD": str(library)},
        )
        ended = alice.wait(job.id, timeout=180)
    assert ended.outcome == "succeeded", ended.reason
    made = [p.name for p in marks.iterdir()]
    # The rank's processes loaded it (as alice); nothing of the platform did (as root).
    assert made, "the preloaded library never ran"
    assert {name.rsplit("-", 1)[1] for name in made} == {str(uid)}, made


def test_a_checkpoint_location_elsewhere_is_refused_and_nothing_is_made_there(
    contained: Hub, targets: dict[str, Any]
) -> None:
    # Refused at submit (the node agent refuses it too, for whatever reaches a node:
    # tests/unit/test_agent_keeper.py).
    elsewhere = Path("/etc") / f"gpufleet-evil-{uuid.uuid4().hex[:8]}"
    alice = Client(contained.controller_api, contained.user_token("alice"))
    with alice, pytest.raises(ApiError) as refused:
        alice.submit(
            "print('ran')\n",
            gpus=1,
            gpu_type="A100-80GB",
            project="vision",
            name="evil-checkpoints",
            checkpoint_uri=str(elsewhere / "ckpt"),
        )
    assert refused.value.status == 400
    assert f"checkpoint_uri {elsewhere / 'ckpt'} must be in " in refused.value.message
    assert "/homes/alice or " in refused.value.message
    assert not elsewhere.exists()
