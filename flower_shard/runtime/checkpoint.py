"""Checkpoints that survive crashes: atomic round directories with a verified manifest.

Layout: ``ROOT/round_000004/`` holds the files of the state after round 4 and a
``MANIFEST.json`` (size and SHA-256 of every file). A checkpoint is written under a temporary
name and renamed only once complete, so a crash mid-write never leaves a half checkpoint under a
real name. Loading verifies the manifest: a corrupt, truncated or incomplete checkpoint is
refused with its reason, and :func:`latest_good` falls back to the previous good one.

Two kinds live in such directories:

- the **server's** (Flower ServerApp): global weights (safetensors), the outer optimizer's state
  (its copy of the global weights and the Nesterov momentum), the round, RNG states and the
  metrics so far;
- a **group's** (every rank, ``torch.distributed.checkpoint``): sharded weights and AdamW state
  (DTensors, so they load onto a different number of ranks), the collective transport's outer
  state, ``trainer.json`` with the step, the LR schedule and each rank's data position, and
  ``extra.safetensors`` (tensors that rank 0 holds alone).

Every checkpoint also holds ``run.json`` (:func:`read_identity`): the run it belongs to (its
name), the group (None for the server's) and the settings it was written under, which a
resumed run is checked against before anything starts.

What verification protects against, and what not: the manifest catches accidents (a crash
mid-write, a truncated copy, a flipped bit, a file left over or missing), and :func:`verify`
refuses an empty manifest, files that are not in it, and symbolic links anywhere in the
checkpoint (a round directory, or its group's directory, that links to another group's). It
is no signature: whoever can write a checkpoint directory can rewrite its manifest too. So
nothing here unpickles code: safetensors and JSON, tensors through ``torch.load(...,
weights_only=True)``, and DCP's metadata through an unpickler that admits only DCP's own
record types (:mod:`~flower_shard.runtime.group_checkpoint`). A tampered checkpoint can still
hold wrong weights: the directories a run reads checkpoints from must be trusted (SECURITY.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from flower_shard import runfiles
from flower_shard.errors import CheckpointError

_log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PREFIX = "round_"
STAGING_SUFFIX = ".tmp"  # .round_000004.tmp: a checkpoint being written
REPLACED_SUFFIX = ".old"  # round_000004.old: a checkpoint being replaced by a rewrite
IDENTITY = runfiles.RUN_FILE  # in every checkpoint: the run, the group, the settings
SERVER_GLOBAL = "global.safetensors"
SERVER_OUTER = "outer.pt"
SERVER_STATE = "state.json"
GROUP_TRAINER = "trainer.json"
GROUP_EXTRA = "extra.safetensors"
SERVER_REQUIRED = (IDENTITY, SERVER_GLOBAL, SERVER_OUTER, SERVER_STATE)


def round_dir(root: str | os.PathLike, rnd: int) -> Path:
    return Path(root) / f"{PREFIX}{rnd:06d}"


def rounds(root: str | os.PathLike) -> list[int]:
    """Rounds that have a (committed) checkpoint directory under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        int(p.name[len(PREFIX) :])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
    ]
    return sorted(found, reverse=True)


def staging_dir(root: str | os.PathLike, rnd: int) -> Path:
    """An empty temporary directory to write round ``rnd``'s files into (see :func:`commit`)."""
    tmp = Path(root) / f".{PREFIX}{rnd:06d}{STAGING_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def clean_staging(checkpoints: str | os.PathLike) -> list[Path]:
    """Remove what an interrupted save or rewrite left in ``checkpoints`` and in each directory
    right under it (``.round_*.tmp``, ``round_*.old``); returns what was removed. Only call it
    when nothing writes there (the run's processes are gone)."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return []
    removed = []
    for root in [checkpoints, *(p for p in checkpoints.iterdir() if p.is_dir())]:
        for p in root.iterdir() if not root.is_symlink() else ():
            staging = p.name.startswith(f".{PREFIX}") and p.name.endswith(STAGING_SUFFIX)
            if (staging or p.name.endswith(REPLACED_SUFFIX)) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def commit(tmp: Path, root: str | os.PathLike, rnd: int, keep: int = 0) -> Path:
    """Write the manifest of ``tmp``, make it durable, and rename it to round ``rnd``'s name.

    ``keep`` > 0 deletes all but the newest ``keep`` committed checkpoints afterwards.
    """
    manifest = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _digest(p)}
        for p in _files(tmp)
    }
    (tmp / MANIFEST).write_text(json.dumps({"round": rnd, "files": manifest}, indent=1))
    for p in [*_files(tmp), tmp / MANIFEST]:
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
    final = round_dir(root, rnd)
    if final.exists():  # a rewrite of the same round (a resumed run): replace it
        old = final.with_name(final.name + REPLACED_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    if keep > 0:
        for old_round in rounds(root)[keep:]:
            shutil.rmtree(round_dir(root, old_round), ignore_errors=True)
    return final


def _manifest(path: Path) -> tuple[dict | None, str | None]:
    """The manifest's file table, or why there is none to trust."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None, f"{path}: no {MANIFEST} (an incomplete write)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{path}: unreadable {MANIFEST} ({exc})"
    if not isinstance(files, dict) or not files:
        return None, f"{path}: {MANIFEST} lists no files (an empty or forged manifest)"
    for name, want in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts or not isinstance(want, dict):
            return None, f"{path}: {MANIFEST} names {name!r}, which is not a file inside it"
    return files, None


def _layout_problem(path: Path, listed: dict) -> str | None:
    """Symbolic links, entries that are not regular files, and files the manifest does not
    list (walked without following links)."""
    for parent in (path, path.parent):
        if parent.is_symlink():
            return f"{parent}: a symbolic link (a checkpoint must be a directory of its own)"
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(top, name)
            rel = str(entry.relative_to(path))
            if entry.is_symlink():
                return f"{path}: {rel} is a symbolic link (not allowed in a checkpoint)"
            if name in files and rel != MANIFEST:
                if not entry.is_file():
                    return f"{path}: {rel} is not a regular file"
                if rel not in listed:
                    return f"{path}: {rel} is not in its {MANIFEST} (a file added afterwards)"
    return None


def verify(
    path: str | os.PathLike, required: tuple[str, ...] = (IDENTITY,), checksums: bool = True
) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when it checks out: a manifest
    that lists files (``required`` among them) with their sizes and SHA-256 sums
    (``checksums=False`` skips hashing: a quick check of the layout), and nothing else."""
    path = Path(path)
    files, reason = _manifest(path)
    if reason:
        return reason
    reason = _layout_problem(path, files)
    if reason:
        return reason
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{path}: {name} is missing"
        size = f.stat().st_size
        if size != want.get("bytes"):
            return f"{path}: {name} has {size} bytes, the manifest says {want.get('bytes')}"
        if checksums and _digest(f) != want.get("sha256"):
            return f"{path}: {name} does not match its checksum (corrupt)"
    missing = [name for name in required if name not in files]
    if missing:
        return f"{path}: {MANIFEST} does not list {', '.join(missing)} (a partial manifest)"
    return None


def good_rounds(
    root: str | os.PathLike,
    *,
    at_most: int | None = None,
    accept: Callable[[int], bool] = lambda _rnd: True,
    log: Callable[[str], None] = _log.warning,
    required: tuple[str, ...] = (IDENTITY,),
) -> Iterator[int]:
    """Rounds under ``root`` whose checkpoint verifies (and that ``accept`` takes), newest
    first, verified lazily; each refused one is logged with its reason."""
    for rnd in rounds(root):
        if (at_most is not None and rnd > at_most) or not accept(rnd):
            continue
        reason = verify(round_dir(root, rnd), required)
        if reason is None:
            yield rnd
        else:
            log(f"checkpoint refused: {reason}; trying the previous one")


def latest_good(
    root: str | os.PathLike,
    *,
    at_most: int | None = None,
    accept: Callable[[int], bool] = lambda _rnd: True,
    log: Callable[[str], None] = _log.warning,
    required: tuple[str, ...] = (IDENTITY,),
) -> tuple[int, Path] | None:
    """The newest checkpoint under ``root`` that verifies (and that ``accept`` takes).

    Each refused one is logged with its reason; None when there is no good checkpoint.
    """
    rnd = next(good_rounds(root, at_most=at_most, accept=accept, log=log, required=required), None)
    return None if rnd is None else (rnd, round_dir(root, rnd))


# -- which run a checkpoint belongs to ----------------------------------------------------------


def write_identity(directory: str | os.PathLike, identity: dict) -> None:
    """Write ``identity`` (JSON: the run's name, the group, the settings) into a checkpoint's
    staging directory (or a checkpoint root, for the ones saved under it)."""
    Path(directory, IDENTITY).write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")


def read_identity(directory: str | os.PathLike) -> dict:
    """The identity a checkpoint (or a checkpoint root) records; :class:`CheckpointError` when
    it has none (written before checkpoints recorded their run) or it is not JSON."""
    path = Path(directory, IDENTITY)
    try:
        identity = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory}: no {IDENTITY}, so not known to belong to this run; resume only "
            "from checkpoints written by this version, or start afresh"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if not isinstance(identity, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return identity


def committed(checkpoints: str | os.PathLike) -> list[Path]:
    """Every committed round directory in ``checkpoints`` and the directories right under it
    (a run directory's ``checkpoints/``: ``server``, ``group_0``, ...)."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return []
    roots = [checkpoints, *(p for p in sorted(checkpoints.iterdir()) if p.is_dir())]
    return [round_dir(root, rnd) for root in roots for rnd in rounds(root)]


# -- the server's checkpoint ----------------------------------------------------------------------


def rng_state() -> dict:
    """Python's and torch's global RNG states (JSON-able)."""
    import torch

    return {"python": repr(random.getstate()), "torch": torch.random.get_rng_state().tolist()}


def restore_rng(state: dict) -> None:
    import ast

    import torch

    random.setstate(ast.literal_eval(state["python"]))
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_server(
    root: str | os.PathLike,
    rnd: int,
    global_arrays: dict[str, np.ndarray],
    outer_state: dict,
    state: dict,
    keep: int = 0,
    extra=None,
    identity: dict | None = None,
) -> Path:
    """Save the server's state after round ``rnd`` (``state`` must be JSON-able); ``extra``,
    when given, writes more files into the staging directory before it is committed;
    ``identity`` is the run's (:func:`write_identity`; empty: a checkpoint that no run will
    take as its own)."""
    import torch
    from safetensors.numpy import save_file

    tmp = staging_dir(root, rnd)
    write_identity(tmp, identity or {})
    save_file({k: np.ascontiguousarray(v) for k, v in global_arrays.items()}, tmp / SERVER_GLOBAL)
    torch.save(outer_state, tmp / SERVER_OUTER)
    full = {"round": rnd, "rng": rng_state(), **state}
    (tmp / SERVER_STATE).write_text(json.dumps(full, indent=1))
    if extra is not None:
        extra(tmp)
    return commit(tmp, root, rnd, keep)


def load_server(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict, dict]:
    """Global arrays, outer optimizer state and the JSON state of a verified server checkpoint."""
    import torch
    from safetensors.numpy import load_file

    path = Path(path)
    reason = verify(path, SERVER_REQUIRED)
    if reason:
        raise CheckpointError(reason)
    arrays = load_file(path / SERVER_GLOBAL)
    outer = torch.load(path / SERVER_OUTER, weights_only=True)
    state = json.loads((path / SERVER_STATE).read_text())
    return arrays, outer, state
