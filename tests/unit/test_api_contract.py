"""The wire contract (``gpufleet.api``): what it holds on its own, apart from the server
parts that read it."""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from gpufleet.api import schemas
from gpufleet.api.events import EventKind
from gpufleet.scheduler import validation

ROOT = Path(__file__).resolve().parents[2]


def test_the_api_imports_pydantic_and_itself_alone() -> None:
    """Every part of the project reads api/; api/ reads nothing of it (DESIGN.md)."""
    outside: list[str] = []
    for path in sorted((ROOT / "api").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):  # relative: api/ itself (level 1) alone
                names = [] if node.level == 1 else [f"{'.' * node.level}{node.module or ''}"]
            else:
                continue
            outside += [
                f"{path.name}: {name}"
                for name in names
                if name.split(".")[0] not in (*sys.stdlib_module_names, "pydantic", "pydantic_core")
            ]
    assert outside == []


def test_the_api_and_the_scheduler_refuse_the_same_characters_in_names_with_one_message() -> None:
    # api/ imports nothing of the project, so it holds its own copy of the name rule; a body
    # the API lets through must not be refused by the scheduler's core, nor the other way.
    differing = [
        f"U+{code:04X}"
        for code in range(sys.maxunicode + 1)
        if schemas.name_problem(f"a{chr(code)}b") != validation.name_problem(f"a{chr(code)}b")
    ]
    assert differing == []
    assert schemas.name_problem("vision\u202e") == validation.name_problem("vision\u202e")
    assert schemas.name_problem("vision\u202e") is not None


# The functions that write an event, and where their kind is among the positional arguments.
EVENT_WRITERS = {"_event": 2, "_event_row": 1, "record_event": 1, "record_session_event": 2}


def _sources() -> dict[str, ast.Module]:
    """Every module of the installed package, parsed: folder per pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = {}
    for folder in set(config["tool"]["setuptools"]["package-dir"].values()):
        for path in (ROOT / folder).glob("*.py"):
            found[str(path.relative_to(ROOT))] = ast.parse(path.read_text(), str(path))
    return found


def _callee(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _kind_arguments(tree: ast.Module) -> Iterator[ast.expr]:
    """What each event-writing call and each ``Event(...)`` gives as the kind; a writer
    handed to ``asyncio.to_thread`` counts, its arguments one place further on."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = _callee(node.func), node.args
        if name == "to_thread" and args:
            name, args = _callee(args[0]), args[1:]
        if name in EVENT_WRITERS and len(args) > EVENT_WRITERS[name]:
            yield args[EVENT_WRITERS[name]]
        if name in EVENT_WRITERS or name == "Event":
            yield from (k.value for k in node.keywords if k.arg == "kind")


def _event_kind_comparisons(tree: ast.Module) -> Iterator[ast.expr]:
    """What ``Event.kind`` is compared with (``==``, ``!=``, ``.in_(...)``)."""

    def is_event_kind(node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "kind"
            and isinstance(node.value, ast.Name)
            and node.value.id == "Event"
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and is_event_kind(node.left):
            yield from node.comparators
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "in_"
            and is_event_kind(node.func.value)
        ):
            yield from node.args


def _kinds_named(node: ast.expr, constants: dict[str, ast.expr]) -> Iterator[str]:
    """The kinds ``node`` may be, as text: a literal's value, ``EventKind.X``'s value, a
    module constant's; ``"?<code>"`` for what is neither (an f-string, an unknown member).
    A name that is no module constant (a parameter, a local) yields nothing: the function
    it reaches takes an EventKind, which mypy checks."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Attribute) and _callee(node.value) == "EventKind":
        member = EventKind.__members__.get(node.attr)
        yield member.value if member is not None else f"?{ast.unparse(node)}"
    elif isinstance(node, ast.IfExp):
        yield from _kinds_named(node.body, constants)
        yield from _kinds_named(node.orelse, constants)
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _kinds_named(element, constants)
    elif isinstance(node, ast.Name):
        if node.id in constants:
            yield from _kinds_named(constants[node.id], constants)
    else:
        yield f"?{ast.unparse(node)}"


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    return {
        target.id: statement.value
        for statement in tree.body
        if isinstance(statement, ast.Assign)
        for target in statement.targets
        if isinstance(target, ast.Name)
    }


def _scan() -> tuple[set[str], list[str]]:
    """The kinds the source writes or looks for, as text, and where one is no EventKind."""
    found: set[str] = set()
    unknown: list[str] = []
    for path, tree in _sources().items():
        constants = _module_constants(tree)
        for node in [*_kind_arguments(tree), *_event_kind_comparisons(tree)]:
            for kind in _kinds_named(node, constants):
                if kind not in set(EventKind):
                    unknown.append(f"{path}:{node.lineno}: {kind}")
                found.add(kind)
    return found, unknown


def test_every_event_kind_written_or_looked_for_is_one_of_the_enums() -> None:
    found, unknown = _scan()
    assert unknown == []
    # The scan finds what it looks for: a literal (the scheduling cycle's rows), a member
    # handed to a writer through asyncio.to_thread, one through a module constant, one of
    # two in a conditional, and one a page looks for.
    assert {
        "admitted",
        "session-cull-failed",
        "gpus-read-back",
        "node-uncordoned",
        "session-cull",
    } <= found


def test_every_event_kind_is_written_or_looked_for_somewhere() -> None:
    """The enum holds the kinds that exist: none that nothing writes or reads."""
    found, _ = _scan()
    for path, tree in _sources().items():
        if path != "api/events.py":
            found |= {
                EventKind[node.attr].value
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and _callee(node.value) == "EventKind"
                and node.attr in EventKind.__members__
            }
    assert set(EventKind) - found == set()


def test_event_kinds_keep_the_text_stored_in_the_events_table() -> None:
    assert len(set(EventKind)) == len(EventKind.__members__)  # no alias: one text, one kind
    for member in EventKind:
        assert member == member.name.lower().replace("_", "-")
    assert EventKind.SESSION_CULL == "session-cull"
    assert f"{EventKind.NODE_CORDONED}" == "node-cordoned"
