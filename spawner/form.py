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


ADMIN_GROUP = "gpufleet-admins"  # hub.setup's: its members hold custom:gpufleet:admin

# Which snapshot a start restores: snapshots are per project, and a start in a project
# restores that project's newest, not a newer one taken in another project. The browser
# asks the controller (its server.js, as a script: see hub/pages.py ServerStatus) and
# says so under the project, again whenever the choice changes; without an answer it
# says nothing.
RESTORE_NOTE = """<script>
(function () {
  var form = document.getElementById("spawn_form");
  var note = document.getElementById("gpufleet-restore");
  var project = document.getElementById("gpufleet-project");
  if (!form || !note || !project || !window.jhdata) return;
  var path = new URL(form.getAttribute("action") || location.href, location.href).pathname;
  var found = /\\/spawn(?:\\/([^/]+))?(?:\\/([^/]+))?\\/?$/.exec(path) || [];
  var user = decodeURIComponent(found[1] || window.jhdata.user || "");
  var server = decodeURIComponent(found[2] || "");
  var script = document.createElement("script");
  script.src = window.jhdata.prefix + "services/gpufleet/server.js?user=" +
    encodeURIComponent(user) + "&server=" + encodeURIComponent(server);
  var snapshots = null;
  function show() {
    if (!snapshots || !snapshots.length) { note.hidden = true; return; }
    var mine = snapshots.filter(function (s) { return s.project === project.value; })[0];
    var newest = snapshots[0];
    var label = project.options[project.selectedIndex].text;
    var text = mine
      ? "Starting in " + label + " restores what its snapshot of " + mine.taken +
        " holds and is missing here (files, installed packages, environments)."
      : "Nothing to restore in " + label + ": snapshots are kept per project.";
    if (newest.project !== project.value) {
      text += " Your newest snapshot, of " + newest.taken + ", is in " +
        newest.project_label + ": start in that project to get it back.";
    }
    note.textContent = text;
    note.hidden = false;
  }
  project.addEventListener("change", show);
  window.gpufleetServerStatus = function (status) { snapshots = status.snapshots; show(); };
  document.head.appendChild(script);
})();
</script>"""

# The hub's spawn page (spawn.html) puts its Start button after the form, outside any
# block a template could replace: where nothing can be started, the form hides it.
NO_START = (
    "<style>#spawn_form .feedback-container, #spawn_form button[type=submit] "
    "{ display: none !important; }</style>"
)


def _admins(options: dict[str, Any]) -> str:
    """Who the gpufleet admins are: by name where the spawn options name them."""
    names = [str(n) for n in options.get("admins") or []]
    if names:
        return "gpufleet's admins: " + ", ".join(f"<b>{escape(n)}</b>" for n in names)
    return f"gpufleet's admins are the members of the hub group <code>{ADMIN_GROUP}</code>"


def unstartable(options: dict[str, Any]) -> str | None:
    """Why this user can start nothing now (HTML for the spawn page, which then shows no
    Start button), or None."""
    if not options["projects"]:
        return (
            '<div class="alert alert-warning" id="gpufleet-no-project" role="alert">'
            "<p><b>You are in no gpufleet project yet</b>, so there is no GPU quota to "
            "start a session under.</p>"
            '<p class="mb-0">Ask an admin to add you to a project\'s group (the hub group '
            f"named like the project; {_admins(options)}), then reload this page.</p>"
            "</div>" + NO_START
        )
    if not options["gpu_types"]:
        return (
            '<div class="alert alert-warning" id="gpufleet-no-gpus" role="alert">No GPU node '
            "has reported to gpufleet yet. Reload this page in a minute, or ask an admin "
            f"to check the node agents ({_admins(options)}).</div>" + NO_START
        )
    return None


def render_form(options: dict[str, Any], previous: dict[str, Any] | None = None) -> str:
    """The form for one user; ``previous`` pre-selects the last choices. Under the
    project, the browser shows which snapshot a start in it restores (``RESTORE_NOTE``)."""
    previous = previous or {}
    projects = options["projects"]
    gpu_types: dict[str, int] = options["gpu_types"]
    refusal = unstartable(options)
    if refusal is not None:
        return refusal
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
  <div class="alert alert-info small" id="gpufleet-restore" role="status" hidden></div>
</div>
{RESTORE_NOTE}
"""


FORM_FIELDS = ("profile", "project", "gpu_type", "gpus")


def options_from_form(form_data: dict[str, list[str]]) -> dict[str, str]:
    """Single values out of the form's lists; validation is the controller's."""
    return {
        key: values[0].strip() for key, values in form_data.items() if key in FORM_FIELDS and values
    }
