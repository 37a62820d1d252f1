"""A host-wide cache of prepared corpora, so the nodes of one host tokenise a corpus once.

A prepared corpus is keyed by its fingerprint (the files' names, sizes and modification times,
the tokenizer, the held-out fraction, the text column and the label field). The first process
that needs it takes the entry's lock (``fcntl.flock``), tokenises into the entry and commits it;
the others wait on the lock and then find it done. A run's data directory then gets hard links
to the entry's files (a copy across file systems), so no run can change the cache and the cache
costs no extra disk.

The cache lives in ``$FLOWER_SHARD_CACHE`` or ``~/.cache/flower-shard``; ``none`` turns it off.
It must be a directory of the current user that no one else can write: a cache another user
could write would let them choose the tokens a run trains on. A directory that fails this check
is not used (each run tokenises into its own directory, and says why once).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "FLOWER_SHARD_CACHE"
OFF = "none"
STAMP = "fingerprint"  # written last: an entry with it is complete


def cache_root() -> Path | None:
    """The cache's ``corpora`` directory (created owner-only), or None when it is off or not
    safe to use."""
    setting = os.environ.get(CACHE_ENV)
    if setting == OFF:
        return None
    base = Path(setting) if setting else Path.home() / ".cache" / "flower-shard"
    root = base / "corpora"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        log.warning("corpus cache %s unusable (%s): tokenising into the run's directory", root, exc)
        return None
    reason = _unsafe(root)
    if reason:
        log.warning(
            "corpus cache %s not used: %s; set %s to a directory of yours", root, reason, CACHE_ENV
        )
        return None
    return root


def _unsafe(path: Path) -> str | None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if st.st_uid != os.getuid():
        return "it belongs to another user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "others can write to it"
    return None


@contextlib.contextmanager
def locked(entry: Path) -> Iterator[None]:
    """Hold the lock of a cache entry (blocks while another process prepares it)."""
    with open(entry.with_name(entry.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def complete(entry: Path, fingerprint: str) -> bool:
    """Whether ``entry`` holds a finished preparation of ``fingerprint``."""
    stamp = entry / STAMP
    return stamp.is_file() and stamp.read_text() == fingerprint


def link_files(entry: Path, out: Path, names: tuple[str, ...]) -> None:
    """Hard-link (or copy, across file systems) ``names`` from ``entry`` into ``out``,
    replacing what is there."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = out / f".{name}.link"
        tmp.unlink(missing_ok=True)
        try:
            os.link(entry / name, tmp)
        except OSError:
            shutil.copyfile(entry / name, tmp)
        os.replace(tmp, out / name)
