"""Prometheus's text format read as a server reads it: each sample under the name it is
written with. (prometheus_client's parser renames a counter's samples to ``<name>_total``,
which would hide the very mistake the metrics tests look for.)"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Scrape:
    types: dict[str, str] = field(default_factory=dict)  # family name → TYPE
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def values(self, name: str) -> list[float]:
        return [value for _, value in self.samples.get(name, [])]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse(text: str) -> Scrape:
    """Every TYPE line and sample; raises ValueError on a line that is neither."""
    scrape = Scrape()
    for line in text.splitlines():
        if not line.strip() or line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            scrape.types[name] = kind
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a sample line: {line!r}")
        name, labels, value = match.groups()
        parsed = {k: _unescape(v) for k, v in _LABEL.findall(labels or "")}
        scrape.samples.setdefault(name, []).append((parsed, float(value)))
    return scrape
