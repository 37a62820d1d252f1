"""Logging: one logger tree (``flower_shard.*``), one verbosity for every process of a run.

Modules log with ``logging.getLogger(__name__)``; the Flower apps (ServerApp, strategy) log
through Flower's own logger where Flower's conventions apply. An entry point calls
:func:`setup` once: it puts one stderr handler on the ``flower_shard`` logger and exports the
level in :data:`LEVEL_ENV`, so the processes it starts (torchrun ranks, a node's group) log at
the same verbosity. What a command prints as its result (the CLI's own output, the rounds'
lines and table) is not logging and stays on stdout.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "FLOWER_SHARD_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"
ROOT = "flower_shard"


def setup(level: str | None = None, *, prefix: str = "flower-shard") -> logging.Logger:
    """Configure the ``flower_shard`` logger (idempotent) and return it.

    Parameters
    ----------
    level
        One of :data:`LEVELS`; None takes :data:`LEVEL_ENV`, else :data:`DEFAULT_LEVEL`.
        Given explicitly, it is exported in :data:`LEVEL_ENV` for child processes.
    prefix
        What each line starts with (``flower-shard``, ``flower-shard group``, ...).
    """
    if level is not None:
        os.environ[LEVEL_ENV] = level
    name = (level or os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL).lower()
    if name not in LEVELS:
        name = DEFAULT_LEVEL
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    logger = logging.getLogger(ROOT)
    for target in (logger, *_main_logger()):
        target.setLevel(name.upper())
        target.propagate = False
        for old in list(target.handlers):
            target.removeHandler(old)
        target.addHandler(handler)
    return logger


def _main_logger() -> list[logging.Logger]:
    """The ``__main__`` logger when a flower_shard module runs as ``python -m`` (torchrun's
    ranks, a node's group): its ``getLogger(__name__)`` is ``__main__``, outside the tree."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return [logging.getLogger("__main__")] if name.startswith(ROOT + ".") else []
