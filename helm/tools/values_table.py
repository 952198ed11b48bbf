"""The chart's values table in helm/gpufleet/README.md, made from values.schema.json (types
and meanings) and values.yaml (defaults), so the three cannot drift apart unseen:
tests/unit/test_chart.py checks that the README holds exactly this table.

    .venv/bin/python helm/tools/values_table.py    rewrites the table in the README
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "gpufleet"
BEGIN = "<!-- values table: written by helm/tools/values_table.py -->"
END = "<!-- end of the values table -->"


def _type(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        kind = " or ".join(kind) if len(kind) < 4 else "any"
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and schema.get("additionalProperties") is not False:
        values = schema.get("additionalProperties")
        return f"map of {_type(values)}" if isinstance(values, dict) and values else "map"
    if kind == "object" and schema.get("properties"):
        return "object: " + ", ".join(schema["properties"])
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" if v else '`""`' for v in schema["enum"])
    return str(kind)


def _default(value: Any) -> str:
    if value is _ABSENT:
        return "—"
    return "`" + json.dumps(value, separators=(", ", ": ")) + "`"


_ABSENT = object()


def _rows(schema: dict[str, Any], values: Any, path: str) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every leaf under ``schema``."""
    properties = schema.get("properties")
    # An object is a row of its own where values.yaml gives some of its keys only (the
    # others optional: resources, a peer), else a row per key.
    whole = values is _ABSENT or (isinstance(values, dict) and set(properties or ()) <= set(values))
    if schema.get("type") == "object" and properties and path and whole:
        for name, sub in properties.items():
            sub_values = values.get(name, _ABSENT) if isinstance(values, dict) else _ABSENT
            yield from _rows(sub, sub_values, f"{path}.{name}")
        return
    meaning = schema.get("description", "").replace("|", "\\|").replace("<", "&lt;")
    yield path, _type(schema), _default(values), meaning
    items = schema.get("items", {})
    if schema.get("type") == "array" and items.get("properties"):
        required = set(items.get("required", ()))
        for name, sub in items["properties"].items():
            for key, kind, _, text in _rows(sub, _ABSENT, f"{path}[].{name}"):
                mark = " (required)" if key == f"{path}[].{name}" and name in required else ""
                yield key, kind, "—", text + mark


def table() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, sub in schema["properties"].items():
        for key, kind, default, meaning in _rows(sub, values.get(name, _ABSENT), name):
            lines.append(f"| `{key}` | {kind} | {default} | {meaning} |")
    return "\n".join(lines)


def readme_with_table(readme: str) -> str:
    before, begin, rest = readme.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"the README has no {BEGIN!r} ... {END!r} section")
    return f"{before}{BEGIN}\n{table()}\n{END}{after}"


def main() -> None:
    readme = CHART / "README.md"
    readme.write_text(readme_with_table(readme.read_text()))
    print(f"wrote the values table of {readme}", file=sys.stderr)


if __name__ == "__main__":
    main()
