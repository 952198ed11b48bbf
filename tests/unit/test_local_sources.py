"""What a local session's snapshots hold: its home, and what it changed outside it (the
overlay upper directory of its sandbox, else the environments conda recorded outside the
home), so that a session stopped for someone else comes back whole."""

from __future__ import annotations

from pathlib import Path

from gpufleet.snapshotter.runner import Sources, local_sources


def conda_home(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A home whose conda list names an environment inside it and one outside it."""
    home, outside = tmp_path / "home", tmp_path / "opt" / "envs" / "torch"
    inside = home / "envs" / "small"
    for prefix in (inside, outside):
        (prefix / "conda-meta").mkdir(parents=True)
    (home / ".conda").mkdir()
    (home / ".conda" / "environments.txt").write_text(f"{inside}\n{outside}\n")
    return home, inside, outside


def test_a_sandboxed_session_holds_its_home_and_its_upper_directory(tmp_path: Path) -> None:
    home, _, _ = conda_home(tmp_path)
    held = local_sources(str(home), "/var/lib/gpufleet/sessions/7/upper", [".cache/pip"])
    assert held == Sources(
        paths=(str(home),),
        overlays=("/var/lib/gpufleet/sessions/7/upper",),
        exclude=(".cache/pip",),
    )


def test_without_an_overlay_the_environments_outside_the_home_are_held(tmp_path: Path) -> None:
    home, _, outside = conda_home(tmp_path)
    held = local_sources(str(home), "", [])
    # The environment inside the home comes with the home.
    assert held == Sources(paths=(str(home),), prefixes=(str(outside),))
