"""Whether an API server stored a manifest as it was sent: :func:`dropped_fields` finds
the fields the server dropped or changed (a field an older server does not know, a value it
normalised differently), so a test against a real server shows what a manifest lost."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .manifests import parse_quantity

# What an API server adds or owns: never a field the manifest lost.
_SERVER_METADATA = frozenset(
    {"uid", "resourceVersion", "creationTimestamp", "managedFields", "generation", "selfLink"}
)
# Plain (non-pointer) fields with omitempty: the server omits them when false or zero.
_OMITTED_WHEN_ZERO = frozenset({"globalDefault", "readOnly"})
_QUANTITY_MAPS = frozenset({"limits", "requests", "overhead"})


def _step(path: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f'{path}["{key}"]'


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, str | list | dict) and not value)


def _same_scalar(sent: Any, got: Any, quantity: bool) -> bool:
    if quantity and isinstance(sent, str | int | float) and isinstance(got, str | int | float):
        try:
            return parse_quantity(sent) == parse_quantity(got)
        except ValueError:
            pass  # not quantities after all: compare them as they are
    return bool(sent == got) and isinstance(sent, bool) == isinstance(got, bool)


def _compare(
    sent: Any, got: Any, path: str, out: list[str], quantity: bool = False, quantities: bool = False
) -> None:
    """``quantity``: ``sent`` is a resource quantity; ``quantities``: its values are."""
    if isinstance(sent, Mapping):
        if not isinstance(got, Mapping):
            out.append(path)
            return
        for key, value in sent.items():
            if (not path and key == "status") or (path == "metadata" and key in _SERVER_METADATA):
                continue
            where = _step(path, key)
            if key not in got:
                zero = value is False or (value == 0 and not isinstance(value, bool))
                if not (_is_empty(value) or (zero and key in _OMITTED_WHEN_ZERO)):
                    out.append(where)
                continue
            _compare(
                value, got[key], where, out, quantities or key == "sizeLimit", key in _QUANTITY_MAPS
            )
    elif isinstance(sent, list):
        if not isinstance(got, list):
            out.append(path)
            return
        # Servers append (admission adds tolerations, volumes, mounts), never reorder.
        for i, value in enumerate(sent):
            if i < len(got):
                _compare(value, got[i], f"{path}[{i}]", out)
            else:
                out.append(f"{path}[{i}]")
    elif not _same_scalar(sent, got, quantity):
        out.append(path)


def dropped_fields(sent: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """The paths of fields of ``sent`` (a manifest) that ``got`` (the API server's read-back
    of it) lacks or changed, e.g. ``spec.securityContext.seccompProfile`` or
    ``metadata.labels["gpufleet.io/user"]``.

    What servers add is not counted: ``status``, ``metadata``'s uid, resourceVersion,
    creationTimestamp, managedFields and generation, defaults in any object, elements
    appended to a list. Empty values the server omits are not counted either, nor a false
    or zero plain field it omits (``globalDefault``, ``readOnly``); quantities compare by
    value (``"1000m"`` equals ``"1"``).
    """
    out: list[str] = []
    _compare(sent, got, "", out)
    return out
