"""Faults on the fake GPUs of a running node agent, as an admin injects them on the demo
(docs/recovery.md, "Injecting faults on the demo")::

    python -m gpufleet.recovery.fake_nvml list
    python -m gpufleet.recovery.fake_nvml xid GPU-1f2e... 48     # or the GPU's index: 2
    python -m gpufleet.recovery.fake_nvml lose 2
    python -m gpufleet.recovery.fake_nvml ecc 2 --corrected 500
    python -m gpufleet.recovery.fake_nvml diagnostics 2 fail "row remap failed"
    python -m gpufleet.recovery.fake_nvml reset 2

Each command changes the agent's control file in place (atomically, keeping its mode: the
sessions' NVML reads it too) and keeps every other line as it is; the library re-reads it at
its next call. The file is ``--control``, else ``$GPUFLEET_FAKE_NVML_CONTROL``, else
``$GPUFLEET_DATA_DIR/agent/fake-nvml/control``, else ``.gpufleet/agent/fake-nvml/control``
under the current directory (the demo's data directory, run from the checkout).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import CONTROL_ENV, reset_gpus

MAX_XIDS = 64  # per GPU, as fake_nvml.c keeps them
ECC_KEYS = {
    "corrected": ("ecc_volatile_corrected", "ecc_aggregate_corrected"),
    "uncorrected": ("ecc_volatile_uncorrected", "ecc_aggregate_uncorrected"),
}
DIAGNOSTICS = "diagnostics"  # beside the control file: "<uuid> fail <why>" lines


class InjectError(Exception):
    """What the admin asked cannot be done; the message says what to do instead."""


@dataclass
class ControlGpu:
    """One GPU as the control file describes it."""

    index: int
    uuid: str
    values: dict[str, str] = field(default_factory=dict)  # gpu.<index>.<key>=<value>, once each
    xids: list[tuple[int, int]] = field(default_factory=list)  # (seq, code), as listed

    @property
    def lost(self) -> bool:
        return self.values.get("lost", "0") != "0"

    def count(self, key: str) -> int:
        try:
            return int(self.values.get(key, "0"))
        except ValueError:
            return 0


def default_control(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the agent keeps its control file (see the module's doc)."""
    if environ.get(CONTROL_ENV):
        return Path(environ[CONTROL_ENV])
    data_dir = Path(environ.get("GPUFLEET_DATA_DIR") or ".gpufleet")
    return data_dir / "agent" / "fake-nvml" / "control"


def read_gpus(control: Path) -> list[ControlGpu]:
    """The control file's GPUs, by index."""
    gpus: dict[int, ControlGpu] = {}
    for line in _lines(control):
        key, _, value = line.partition("=")
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "gpu" or not parts[1].isdigit():
            continue
        gpu = gpus.setdefault(int(parts[1]), ControlGpu(int(parts[1]), ""))
        if parts[2] == "uuid":
            gpu.uuid = value
        elif parts[2] == "xid":
            seq, _, code = value.partition(",")
            if seq.isdigit() and code.isdigit():
                gpu.xids.append((int(seq), int(code)))
        else:
            gpu.values[parts[2]] = value
    return [gpus[i] for i in sorted(gpus)]


def find_gpu(control: Path, which: str) -> ControlGpu:
    """The GPU ``which`` names: its index in the control file, its UUID, or the start of
    one UUID (``GPU-1f2e``)."""
    gpus = read_gpus(control)
    text = which.strip()
    if text.isdigit():
        for gpu in gpus:
            if gpu.index == int(text):
                return gpu
        raise InjectError(f"there is no GPU {text} in {control}: indexes 0..{len(gpus) - 1}")
    matches = [g for g in gpus if g.uuid == text] or [
        g for g in gpus if text and g.uuid.lower().startswith(text.lower())
    ]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise InjectError(
            f"no GPU in {control} has the UUID {text!r}: give its index or UUID "
            "(`python -m gpufleet.recovery.fake_nvml list` shows them)"
        )
    raise InjectError(
        f"{text!r} starts the UUIDs of GPUs {', '.join(str(g.index) for g in matches)}: "
        "give more of it, or the index"
    )


def queue_xid(control: Path, which: str, code: int) -> tuple[ControlGpu, int]:
    """Queue a critical XID on a GPU; the GPU and the event's sequence number. The agent's
    event wait delivers it once (a sequence number above every one listed for the GPU)."""
    if not 0 < code < 2**32:
        raise InjectError(f"XID {code} is not one: an XID is a positive number such as 48 or 79")
    gpu = find_gpu(control, which)
    if len(gpu.xids) >= MAX_XIDS:
        raise InjectError(
            f"GPU {gpu.index} already lists {MAX_XIDS} XIDs, as many as the library keeps: "
            f"`reset {gpu.index}` clears them"
        )
    seq = max([time.time_ns(), *(s + 1 for s, _ in gpu.xids)])
    lines = _lines(control)
    lines.append(f"gpu.{gpu.index}.xid={seq},{code}")
    _replace(control, lines)
    return gpu, seq


def set_values(control: Path, which: str, values: Mapping[str, int]) -> ControlGpu:
    """Set scalar readings of a GPU (``lost``, ECC counters, ...), keeping every other line."""
    gpu = find_gpu(control, which)
    prefix = f"gpu.{gpu.index}."
    pending = dict(values)
    lines = []
    for line in _lines(control):
        key = line.partition("=")[0]
        name = key.removeprefix(prefix)
        if key.startswith(prefix) and name in pending:
            line = f"{key}={pending.pop(name)}"
        lines.append(line)
    lines += [f"{prefix}{name}={value}" for name, value in pending.items()]
    _replace(control, lines)
    return find_gpu(control, str(gpu.index))


def add_ecc(control: Path, which: str, corrected: int, uncorrected: int) -> ControlGpu:
    """Raise a GPU's ECC counts as errors do: volatile (since the last reset) and aggregate
    (for the GPU's life) alike."""
    if corrected < 0 or uncorrected < 0:
        raise InjectError("ECC counts only rise: give --corrected and --uncorrected as 0 or more")
    gpu = find_gpu(control, which)
    values = {}
    for kind, added in (("corrected", corrected), ("uncorrected", uncorrected)):
        for key in ECC_KEYS[kind]:
            values[key] = gpu.count(key) + added
    return set_values(control, which, values)


def set_diagnostics(control: Path, which: str, failing: str | None) -> ControlGpu:
    """Make the fake diagnostics fail the GPU with ``failing`` as the reason, or pass it
    (``None``): the file the agent's maintenance reads beside the control file."""
    gpu = find_gpu(control, which)
    path = control.parent / DIAGNOSTICS
    lines = [
        line
        for line in (path.read_text(encoding="utf-8").splitlines() if path.exists() else [])
        if line.split(" ", 1)[0] != gpu.uuid
    ]
    if failing is not None:
        reason = " ".join(failing.split()) or "failed"
        lines.append(f"{gpu.uuid} fail {reason}")
    _write(path, "".join(f"{line}\n" for line in lines), 0o644)
    return gpu


def _lines(control: Path) -> list[str]:
    try:
        return control.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InjectError(
            f"no fake NVML control file at {control}: the node agent writes it when it serves "
            f"declared GPUs; pass --control, or set ${CONTROL_ENV} or $GPUFLEET_DATA_DIR "
            "(the hub's data directory)"
        ) from None
    except PermissionError:
        raise InjectError(
            f"cannot read {control}: run this as the account the hub runs as (root)"
        ) from None


def _replace(control: Path, lines: Sequence[str]) -> None:
    _write(control, "".join(f"{line}\n" for line in lines), control.stat().st_mode & 0o777)


def _write(path: Path, text: str, mode: int) -> None:
    """Atomically, with ``mode``: sessions and job ranks read the control file through
    their own NVML, as their own users."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ------------------------------------------------------------------ the command


def _table(gpus: Sequence[ControlGpu]) -> str:
    rows = [("GPU", "UUID", "LOST", "ECC CORRECTED", "ECC UNCORRECTED", "XIDS LISTED")]
    for g in gpus:
        corrected = "/".join(str(g.count(k)) for k in ECC_KEYS["corrected"])
        uncorrected = "/".join(str(g.count(k)) for k in ECC_KEYS["uncorrected"])
        xids = ", ".join(str(code) for _, code in g.xids) or "-"
        rows.append((str(g.index), g.uuid, "lost" if g.lost else "-", corrected, uncorrected, xids))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    return text + "\n(ECC counts: volatile/aggregate; each XID listed is delivered once)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpufleet.recovery.fake_nvml",
        description="Inject faults on the fake GPUs a node agent serves (the demo's "
        "declared nodes): docs/recovery.md, 'Injecting faults on the demo'.",
    )
    parser.add_argument(
        "--control",
        type=Path,
        help=f"the control file (default: ${CONTROL_ENV}, else "
        "$GPUFLEET_DATA_DIR/agent/fake-nvml/control, else ./.gpufleet/agent/fake-nvml/control)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("list", help="the fake GPUs: index, UUID, lost, ECC counts, XIDs")
    gpu_help = "the GPU: its index (from `list`), its UUID or the start of it"
    xid = commands.add_parser("xid", help="deliver a critical XID (48: GPU fault, 79: off the bus)")
    xid.add_argument("gpu", help=gpu_help)
    xid.add_argument("code", type=int, help="the XID, e.g. 48, 63, 79")
    lose = commands.add_parser("lose", help="the GPU falls off the bus (NVML: GPU is lost)")
    lose.add_argument("gpu", help=gpu_help)
    ecc = commands.add_parser("ecc", help="raise the GPU's ECC error counts")
    ecc.add_argument("gpu", help=gpu_help)
    ecc.add_argument("--corrected", type=int, default=0, help="single-bit errors to add")
    ecc.add_argument("--uncorrected", type=int, default=0, help="double-bit errors to add")
    diag = commands.add_parser(
        "diagnostics", help="whether the fake diagnostics (after a recycle) pass or fail it"
    )
    diag.add_argument("gpu", help=gpu_help)
    diag.add_argument("verdict", choices=("pass", "fail"))
    diag.add_argument("reason", nargs="*", help="why it fails, as the maintenance event says")
    reset = commands.add_parser(
        "reset", help="what a GPU reset does: back on the bus, XIDs and volatile ECC cleared"
    )
    reset.add_argument("gpu", nargs="+", help=gpu_help)
    return parser


def run(args: argparse.Namespace) -> str:
    """Carry out one command; what to print."""
    control: Path = args.control or default_control()
    actions: dict[str, Callable[[], str]] = {
        "list": lambda: _table(read_gpus(control)),
        "xid": lambda: _xid(control, args.gpu, args.code),
        "lose": lambda: _lose(control, args.gpu),
        "ecc": lambda: _ecc(control, args.gpu, args.corrected, args.uncorrected),
        "diagnostics": lambda: _diagnostics(control, args.gpu, args.verdict, args.reason),
        "reset": lambda: _reset(control, args.gpu),
    }
    return actions[args.command]()


def _xid(control: Path, which: str, code: int) -> str:
    gpu, _ = queue_xid(control, which, code)
    return f"XID {code} queued on GPU {gpu.index} ({gpu.uuid}): the node agent reports it at once"


def _lose(control: Path, which: str) -> str:
    gpu = set_values(control, which, {"lost": 1})
    return (
        f"GPU {gpu.index} ({gpu.uuid}) is lost: the node agent's next sample (within 5 s) "
        f"reports it; `reset {gpu.index}` brings it back"
    )


def _ecc(control: Path, which: str, corrected: int, uncorrected: int) -> str:
    gpu = add_ecc(control, which, corrected, uncorrected)
    return (
        f"GPU {gpu.index} ({gpu.uuid}) ECC errors now: corrected "
        + "/".join(str(gpu.count(k)) for k in ECC_KEYS["corrected"])
        + ", uncorrected "
        + "/".join(str(gpu.count(k)) for k in ECC_KEYS["uncorrected"])
        + " (volatile/aggregate)"
    )


def _diagnostics(control: Path, which: str, verdict: str, reason: Sequence[str]) -> str:
    failing = (" ".join(reason) or "failed") if verdict == "fail" else None
    gpu = set_diagnostics(control, which, failing)
    if failing is None:
        return f"diagnostics pass GPU {gpu.index} ({gpu.uuid})"
    return f"diagnostics fail GPU {gpu.index} ({gpu.uuid}): {failing}"


def _reset(control: Path, which: Sequence[str]) -> str:
    uuids = [find_gpu(control, w).uuid for w in which]
    reset_gpus(control, uuids)
    return f"reset {', '.join(uuids)}: on the bus, XIDs and volatile ECC counts cleared"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(run(args))
    except InjectError as e:
        print(f"gpufleet fake NVML: {e}", file=sys.stderr)
        return 2
    return 0
