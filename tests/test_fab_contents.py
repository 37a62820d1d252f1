"""The Flower App (FAB) that `flwr run .` uploads holds the app and nothing else.

Built with Flower's own functions, the ones `flwr run` and `flwr build` call, from this
project's files plus stand-ins for what a user's checkout may hold besides (a FLWR_HOME under
the project, as docs/first-federated-run.md sets one, benchmarks, tests, docs).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_files
from flwr.cli.utils import collect_files

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "flower_shard/"
# Beside the package: the project's metadata (Flower rewrites it into the FAB), the README it
# names, and Flower's own manifest.
TOP_LEVEL = {"pyproject.toml", "README.md", ".info/CONTENT"}
NEVER = ("bench/", "tests/", "docs/", "examples/", "flwr-home/", ".venv/", "runs/")

# What a checkout may hold on top of the repository's files.
STRAYS = {
    "flwr-home/config.toml": b'[superlink]\ndefault = "local-deployment"\n',
    "flwr-home/apps/x/y.py": b"",
    "bench/extra.py": b"",
    "docs/extra.md": b"# extra\n",
    "tests/extra_check.py": b"",
    "runs/demo/summary.json": b"{}",
    "notes.md": b"# notes\n",
    "scratch.py": b"",
}

# Flower builds the FAB with pathspec's "gitwildmatch" patterns, deprecated there: not ours.
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")


def built_fab(tmp_path: Path) -> list[str]:
    files = {**collect_files(ROOT), **STRAYS}
    fab, _ = build_fab_from_files(files)
    path = tmp_path / "flower-shard.fab"
    path.write_bytes(fab)
    with zipfile.ZipFile(path) as z:
        return z.namelist()


def test_the_fab_holds_the_package_and_nothing_else(tmp_path):
    names = built_fab(tmp_path)
    strays = [n for n in names if not n.startswith(PACKAGE) and n not in TOP_LEVEL]
    assert not strays, f"files in the FAB besides the app: {strays}"
    assert not [n for n in names if n.startswith(NEVER)]
    assert not [n for n in names if "__pycache__" in n]


def test_the_fab_holds_every_module_of_the_package(tmp_path):
    names = set(built_fab(tmp_path))
    modules = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "flower_shard").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules <= names, sorted(modules - names)
    assert "pyproject.toml" in names and "README.md" in names


def test_the_fab_is_small(tmp_path):
    files = {**collect_files(ROOT), **STRAYS}
    fab, _ = build_fab_from_files(files)
    assert len(fab) < 2 * 1024 * 1024, len(fab)  # Flower refuses more than 10 MB


def test_git_ignores_a_flwr_home_in_the_project():
    patterns = (ROOT / ".gitignore").read_text().split()
    assert "flwr-home/" in patterns or "/flwr-home/" in patterns


def test_the_staged_app_that_runs_use_builds_the_same_fab(tmp_path):
    """Deployments run `flwr run` on a copy of the app's files (the walk of a checkout with
    its .venv costs seconds a run); the FAB must be the same, byte for byte."""
    from flwr.cli.build import build_fab_from_disk

    from flower_shard.launch.fab import staged_app

    assert build_fab_from_disk(staged_app(tmp_path / "app")) == build_fab_from_disk(ROOT)
