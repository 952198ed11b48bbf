"""Structured logs: one JSON object a line, with the fields a log pipeline can index."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Fields passed with ``extra={...}`` become top-level keys.
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(logger: logging.Logger, fmt: str, level: int) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JSONFormatter()
        if fmt == "json"
        else logging.Formatter("[%(levelname)1.1s %(asctime)s %(name)s] %(message)s")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
