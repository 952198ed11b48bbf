"""scripts/deb-src-entry: the deb-src entry scripts/install --k8s adds comes from the
machine's own deb entries (its mirror or proxy, its suite, components and keyring), read
from a directory of fake apt files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "deb-src-entry"
BOOKWORM = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nVERSION_CODENAME=bookworm\nID=debian\n'


def fake_root(tmp: Path, files: dict[str, str], os_release: str = BOOKWORM) -> Path:
    (tmp / "etc/apt/sources.list.d").mkdir(parents=True)
    (tmp / "etc/os-release").write_text(os_release)
    for name, text in files.items():
        (tmp / "etc/apt" / name).write_text(textwrap.dedent(text))
    return tmp


def entry(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def fields(text: str) -> list[str]:
    """The entry without its comment header."""
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_a_deb822_mirror_with_its_own_keyring_is_copied_for_the_main_suite(tmp_path: Path) -> None:
    # As Debian 12 ships it (this machine's layout), behind a caching proxy.
    root = fake_root(
        tmp_path,
        {
            "sources.list.d/debian.sources": """\
                Types: deb
                # http://snapshot.debian.org/archive/debian/20250520T000000Z
                URIs: http://apt-cache.internal:3142/debian
                Suites: bookworm bookworm-updates
                Components: main contrib
                Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

                Types: deb
                URIs: http://apt-cache.internal:3142/debian-security
                Suites: bookworm-security
                Components: main
                Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
                """,
        },
    )
    done = entry(root)
    assert done.returncode == 0, done.stderr
    assert fields(done.stdout) == [
        "Types: deb-src",
        "URIs: http://apt-cache.internal:3142/debian",
        "Suites: bookworm",
        "Components: main contrib",
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg",
    ]
    assert "sources.list.d/debian.sources" in done.stdout  # the header says where from


MIRROR = (
    "deb [arch=amd64 signed-by=/etc/apt/keyrings/m.gpg] https://mirror.example/debian/ "
    "bookworm main contrib"
)


def test_a_one_line_sources_list_with_signed_by_and_a_security_line_first(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        {
            "sources.list": f"""\
                # deb http://deb.debian.org/debian bookworm main
                deb http://security.debian.org/debian-security bookworm-security main
                deb-src http://old.example/debian bookworm main
                {MIRROR}
                deb https://mirror.example/debian/ bookworm-updates main
                """,
        },
    )
    done = entry(root)
    assert done.returncode == 0, done.stderr
    assert fields(done.stdout) == [
        "Types: deb-src",
        "URIs: https://mirror.example/debian/",
        "Suites: bookworm",
        "Components: main contrib",
        "Signed-By: /etc/apt/keyrings/m.gpg",
    ]


def test_disabled_entries_and_the_entry_it_wrote_itself_are_skipped(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        {
            "sources.list.d/a-old.sources": """\
                Types: deb
                URIs: http://gone.example/debian
                Suites: bookworm
                Components: main
                Enabled: no
                """,
            "sources.list.d/gpufleet-src.sources": """\
                Types: deb deb-src
                URIs: http://deb.debian.org/debian
                Suites: bookworm
                Components: main
                """,
            "sources.list.d/z-mirror.list": "deb http://proxy.example/debian bookworm main\n",
        },
    )
    done = entry(root)
    assert done.returncode == 0, done.stderr
    # No Signed-By where the entry has none: apt's trusted keys verify it, as they do now.
    assert fields(done.stdout) == [
        "Types: deb-src",
        "URIs: http://proxy.example/debian",
        "Suites: bookworm",
        "Components: main",
    ]


def test_an_inline_key_is_carried_over_whole(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        {
            "sources.list.d/debian.sources": """\
                Types: deb
                URIs: http://deb.example/debian
                Suites: trixie
                Components: main
                Signed-By:
                 -----BEGIN PGP PUBLIC KEY BLOCK-----
                 .
                 mDMEZabc
                 -----END PGP PUBLIC KEY BLOCK-----
                """,
        },
        os_release="VERSION_CODENAME=trixie\n",
    )
    done = entry(root)
    assert done.returncode == 0, done.stderr
    assert fields(done.stdout)[-5:] == [
        "Signed-By:",
        " -----BEGIN PGP PUBLIC KEY BLOCK-----",
        " .",
        " mDMEZabc",
        " -----END PGP PUBLIC KEY BLOCK-----",
    ]
    assert "Suites: trixie" in done.stdout


def test_no_entry_for_the_main_suite_says_what_to_do(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        {"sources.list": "deb http://deb.debian.org/debian bookworm-updates main\n"},
    )
    done = entry(root)
    assert done.returncode == 2 and done.stdout == ""
    assert "no deb entry for the suite 'bookworm'" in done.stderr
    assert "gpufleet-src.sources yourself" in done.stderr
    # Without a codename the suite must be named; named, it is used.
    no_codename = fake_root(
        tmp_path / "sid",
        {"sources.list": "deb http://deb.debian.org/debian sid main\n"},
        os_release="ID=debian\n",
    )
    unnamed = entry(no_codename)
    assert unnamed.returncode == 2 and "pass --suite NAME" in unnamed.stderr
    named = entry(no_codename, "--suite", "sid")
    assert named.returncode == 0 and "Suites: sid" in named.stdout
