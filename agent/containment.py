"""Job ranks in their user's containment: the session sandbox, as the user's account.

A job's script, interpreter, working directory and environment are the researcher's
choice, so a pod's ``torchrun`` runs only inside the sandbox of
:mod:`gpufleet.snapshotter.sandbox`, as the uid the controller recorded for the user
(docs/containment.md), never as root or as the agent:

- its ``/`` holds the host's allow-listed directories (``DEFAULT_ROOT``) as overlay layers,
  with the job's copy of its session's upper directory stacked above them when the job
  came from a session (so it runs in that session's environment as it was at submit, and
  every later attempt does too), and a layer of the pod's own on top;
- the user's home, the pod's log directory and the job's checkpoint directory are bound
  read-write; the sessions' base environment, the entry script and the fake NVML library
  read-only; nothing of the agent, the hub or another user is there;
- its processes have a pid namespace of their own;
- what the submission chose (``env``, including ``LD_PRELOAD``, ``python``, ``cwd``) applies
  only after the switch to the user: bwrap and setpriv run with the agent's own minimal
  environment, and ``env -i`` sets the rank's inside.

Pure: :func:`rank_command` builds the command line; the keeper prepares the directories.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..snapshotter.sandbox import RootEntry, SandboxDirs, SandboxSupport, sandbox_argv

# What the agent's own processes of a pod (bwrap, setpriv) run with: no variable a
# submission chose ever reaches them.
OUTER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin")


@dataclass(frozen=True)
class RankAccount:
    """Whom a pod's ranks run as."""

    username: str
    uid: int
    gid: int
    home: Path


def rank_command(
    support: SandboxSupport,
    dirs: SandboxDirs,
    *,
    root: Sequence[RootEntry],
    account: RankAccount,
    base_env: Path,
    prefix: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    writable: Sequence[Path],
    read_only: Sequence[tuple[Path, Path]],
    pinned: Path | None,
    writable_at: Sequence[tuple[Path, Path]] = (),
) -> list[str]:
    """The command line that runs ``argv`` (torchrun) as ``account`` in the pod's sandbox,
    with exactly ``env`` inside, from ``prefix``'s virtualenv over ``base_env`` (made in
    the pod's own layer if the pinned environment has none); ``read_only`` as ``(source,
    destination)`` pairs, bound last. Raises ``ValueError`` where the
    sandbox cannot be built (:func:`sandbox_argv`)."""
    launcher = [
        str(base_env / "bin" / "python"),
        "-m",
        "gpufleet.spawner.session_venv",
        str(prefix),
        "--",
        *argv,
    ]
    inner = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *launcher]
    binds = [(path, path) for path in dict.fromkeys(writable) if path != account.home]
    binds += writable_at
    shown = [(base_env, base_env), *read_only]
    sandboxed = sandbox_argv(
        support,
        upper=dirs.upper,
        work=dirs.work,
        merged=dirs.merged,
        home=account.home,
        binds=binds,
        env_prefix=None,
        argv=inner,
        root=root,
        tmp=dirs.tmp,
        user=(account.uid, account.gid),
        read_only=shown,
        lowers=[pinned] if pinned is not None and support.overlay else [],
        chdir=cwd,
    )
    # The rank runner starts it under a shell of the rank's own (runner.LAUNCHER), which
    # outlives the agent: bwrap's --die-with-parent then follows that shell, not the agent,
    # which must be able to restart without stopping training.
    return sandboxed


def rank_environment(
    account: RankAccount,
    base_env: Path,
    prefix: Path,
    chosen: Mapping[str, str],
    platform: Mapping[str, str],
) -> dict[str, str]:
    """The variables a rank starts with: the user's basics, what the submission ``chosen``,
    then the platform's (``platform``: marker, GPUs, job ids), which a submission cannot
    override. Pure."""
    basics = {
        "PATH": ":".join([str(prefix / "bin"), str(base_env / "bin"), *SYSTEM_PATH]),
        "HOME": str(account.home),
        "USER": account.username,
        "LOGNAME": account.username,
        "LANG": "C.UTF-8",
        "VIRTUAL_ENV": str(prefix),
    }
    return {**basics, **chosen, **platform}
