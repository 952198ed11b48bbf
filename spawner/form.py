"""The spawn page's form (pure: spawn options in, HTML out) and its parsing."""

from __future__ import annotations

from html import escape
from typing import Any


def _options(items: list[tuple[str, str]], selected: str | None) -> str:
    return "".join(
        f'<option value="{escape(value)}"{" selected" if value == selected else ""}>'
        f"{escape(label)}</option>"
        for value, label in items
    )


def render_form(options: dict[str, Any], previous: dict[str, Any] | None = None) -> str:
    """The form for one user; ``previous`` pre-selects the last choices."""
    previous = previous or {}
    projects = options["projects"]
    gpu_types: dict[str, int] = options["gpu_types"]
    if not projects:
        return (
            '<div class="alert alert-warning" id="gpufleet-no-project">You are in no gpufleet '
            "project yet. Ask an admin to add you to a project's group.</div>"
        )
    if not gpu_types:
        return (
            '<div class="alert alert-warning" id="gpufleet-no-gpus">No GPU node has reported '
            "to gpufleet yet. Try again in a minute, or ask an admin to check the node "
            "agents.</div>"
        )
    default_profile = next(
        (p["name"] for p in options["profiles"] if p["default"]),
        options["profiles"][0]["name"] if options["profiles"] else None,
    )
    quota_lines = "".join(
        f'<li data-project="{escape(p["name"])}">{escape(p["display_name"])}: '
        + (
            ", ".join(
                f"{q['used']} of {q['guaranteed']} {escape(q['gpu_type'])} in use"
                for q in p["quotas"]
            )
            or "no guaranteed GPUs"
        )
        + "</li>"
        for p in projects
    )
    profile_field = ""
    if options["profiles"]:
        profile_field = f"""
  <div class="form-group mb-3">
    <label for="gpufleet-profile" class="form-label">Environment</label>
    <select class="form-select form-control" name="profile" id="gpufleet-profile">
      {
            _options(
                [(p["name"], p["display_name"]) for p in options["profiles"]],
                previous.get("profile", default_profile),
            )
        }
    </select>
  </div>"""
    largest = max(gpu_types.values())
    return f"""
<div id="gpufleet-spawn-form">
  {profile_field}
  <div class="form-group mb-3">
    <label for="gpufleet-project" class="form-label">Project</label>
    <select class="form-select form-control" name="project" id="gpufleet-project">
      {
        _options(
            [(p["name"], p["display_name"]) for p in projects],
            previous.get("project", projects[0]["name"]),
        )
    }
    </select>
  </div>
  <div class="form-group mb-3">
    <label for="gpufleet-gpu-type" class="form-label">GPU type</label>
    <select class="form-select form-control" name="gpu_type" id="gpufleet-gpu-type">
      {
        _options(
            [(t, f"{t} (up to {n} per session)") for t, n in gpu_types.items()],
            previous.get("gpu_type", next(iter(gpu_types))),
        )
    }
    </select>
  </div>
  <div class="form-group mb-3">
    <label for="gpufleet-gpus" class="form-label">GPUs</label>
    <input class="form-control" type="number" name="gpus" id="gpufleet-gpus" min="1"
      max="{largest}" step="1" value="{escape(str(previous.get("gpus", 1)))}">
  </div>
  <div class="text-muted small" id="gpufleet-note">
    <p class="mb-1">Your projects:</p>
    <ul class="small">{quota_lines}</ul>
    <p>When the project's GPUs are all in use your session waits in a queue and starts by
    itself as soon as GPUs free up.</p>
  </div>
</div>
"""


FORM_FIELDS = ("profile", "project", "gpu_type", "gpus")


def options_from_form(form_data: dict[str, list[str]]) -> dict[str, str]:
    """Single values out of the form's lists; validation is the controller's."""
    return {
        key: values[0].strip() for key, values in form_data.items() if key in FORM_FIELDS and values
    }
