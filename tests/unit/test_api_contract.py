"""The wire contract (``gpufleet.api``): what it holds on its own, apart from the server
parts that read it."""

from __future__ import annotations

import sys

from gpufleet.api import schemas
from gpufleet.scheduler import validation


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
