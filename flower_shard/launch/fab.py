"""The Flower App that ``flwr run`` uploads, staged in a directory of its own.

Flower 1.42's ``flwr run DIR`` walks every file under ``DIR`` (resolving each path) before it
applies the app's ``fab-include`` patterns: from this project's checkout, with its ``.venv``
inside, that is some 5 s of CPU for each run. A run started from :func:`staged_app` walks
only the files the FAB holds (pyproject.toml, README.md and the package's modules), so the
FAB is the same and ``flwr run`` starts at once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[2]  # the Flower App: this project's pyproject
PACKAGE = "flower_shard"
TOP_LEVEL = ("pyproject.toml", "README.md")


def staged_app(directory: Path) -> Path:
    """Copy the app's files into ``directory`` (made if missing, replaced if there) and
    return it: a directory to give ``flwr run``."""
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for name in TOP_LEVEL:
        shutil.copy2(APP_DIR / name, directory / name)
    for source in (APP_DIR / PACKAGE).rglob("*.py"):
        target = directory / source.relative_to(APP_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return directory
