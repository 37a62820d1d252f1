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
  state, and ``trainer.pt`` with the step, the LR schedule and each rank's data position.
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

from flower_shard.errors import CheckpointError

_log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PREFIX = "round_"
SERVER_GLOBAL = "global.safetensors"
SERVER_OUTER = "outer.pt"
SERVER_STATE = "state.json"
GROUP_TRAINER = "trainer.pt"


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
    tmp = Path(root) / f".{PREFIX}{rnd:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


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
        old = final.with_name(final.name + ".old")
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


def verify(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when every file checks out."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{path}: no {MANIFEST} (an incomplete write)"
    except (ValueError, KeyError) as exc:
        return f"{path}: unreadable {MANIFEST} ({exc})"
    for name, want in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{path}: {name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{path}: {name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _digest(f) != want["sha256"]:
            return f"{path}: {name} does not match its checksum (corrupt)"
    return None


def good_rounds(
    root: str | os.PathLike,
    *,
    at_most: int | None = None,
    accept: Callable[[int], bool] = lambda _rnd: True,
    log: Callable[[str], None] = _log.warning,
) -> Iterator[int]:
    """Rounds under ``root`` whose checkpoint verifies (and that ``accept`` takes), newest
    first, verified lazily; each refused one is logged with its reason."""
    for rnd in rounds(root):
        if (at_most is not None and rnd > at_most) or not accept(rnd):
            continue
        reason = verify(round_dir(root, rnd))
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
) -> tuple[int, Path] | None:
    """The newest checkpoint under ``root`` that verifies (and that ``accept`` takes).

    Each refused one is logged with its reason; None when there is no good checkpoint.
    """
    rnd = next(good_rounds(root, at_most=at_most, accept=accept, log=log), None)
    return None if rnd is None else (rnd, round_dir(root, rnd))


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
) -> Path:
    """Save the server's state after round ``rnd`` (``state`` must be JSON-able); ``extra``,
    when given, writes more files into the staging directory before it is committed."""
    import torch
    from safetensors.numpy import save_file

    tmp = staging_dir(root, rnd)
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
    reason = verify(path)
    if reason:
        raise CheckpointError(reason)
    arrays = load_file(path / SERVER_GLOBAL)
    outer = torch.load(path / SERVER_OUTER, weights_only=True)
    state = json.loads((path / SERVER_STATE).read_text())
    return arrays, outer, state
