"""``flower-supernode`` with a short idle poll and a warm ClientApp process.

Three costs of a Flower 1.42 round that are not training, removed here:

- The SuperNode sleeps 3 s after every pull that found no message (and 0.5 s while it waits
  for a reply): up to ~3.5 s of pure waiting per round. This entry point runs the stock
  SuperNode with those sleeps capped at ``FLOWER_SHARD_SUPERNODE_POLL`` seconds (default 0.1).
  The cost is more pull requests to the SuperLink (10 per second per idle node at 0.1 s): set
  3 to get Flower's own behaviour.
- Every hop that pulls a message's objects (SuperNode from SuperLink, ClientApp from
  SuperNode, ServerApp from SuperLink) retries an object that is not there yet after 1 s, then
  2, 4, ... 10 s. A message is announced before its objects have arrived (the SuperNode stores
  it, then pulls its objects), so a pull that starts a few milliseconds early waits 1-3 s.
  :func:`fast_object_pulls` starts the retries at 50 ms (cap 1 s) in each process it runs in.
- The SuperExec it spawns starts a fresh ClientApp process per message (seconds of imports).
  Here it spawns ``flower_shard.flower.node.warm_superexec`` instead, with the same
  arguments, which runs every ClientApp task in one warm process, and starts it again should it die.
  ``FLOWER_SHARD_WARM_CLIENTAPP=0`` keeps Flower's.

    python -m flower_shard.flower.node.fast_supernode [flower-supernode arguments]
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess as _subprocess
import sys
import threading
import time as _time

from flower_shard import logs
from flower_shard.launch.guard import guarded

logger = logging.getLogger(__name__)

POLL_ENV = "FLOWER_SHARD_SUPERNODE_POLL"
PULL_ENV = "FLOWER_SHARD_PULL_BACKOFF"
WARM_ENV = "FLOWER_SHARD_WARM_CLIENTAPP"
"""0: Flower's own process-per-message ClientApp; anything else: one warm process."""


def fast_object_pulls() -> None:
    """Retry a missing object after ``FLOWER_SHARD_PULL_BACKOFF`` seconds (default 0.05),
    doubling up to 1 s; a value of 1 or more gives Flower's own (1 s, doubling up to 10 s)."""
    from flwr.supercore.inflatable import inflatable_utils

    first = float(os.environ.get(PULL_ENV, "0.05"))
    cap = 10.0 if first >= 1 else 1.0
    for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        pull.__kwdefaults__.update(initial_backoff=first, backoff_cap=cap)


class _WarmSuperExec:
    """The ``subprocess`` module, with ``flower-superexec`` swapped for the warm one.

    The SuperNode starts its SuperExec once and never looks at it again: if it died, the node
    would stay connected and never run a task. Here a watcher starts it again, logged, for as
    long as the SuperNode lives; one that keeps dying at start-up (``CRASH_LOOP`` times within
    ``EARLY_EXIT_S`` of starting) stops the SuperNode instead, so that ``flower-shard node``
    sees the node die and says why.
    """

    EARLY_EXIT_S = 10.0
    CRASH_LOOP = 3

    def __getattr__(self, name):
        return getattr(_subprocess, name)

    @classmethod
    def Popen(cls, command, *args, **kwargs):  # noqa: N802 - the name being replaced
        if not (command and command[0] == "flower-superexec"):
            return _subprocess.Popen(command, *args, **kwargs)
        # Guarded: it gets SIGTERM the moment this SuperNode dies (Flower's own --parent-pid
        # watch polls, and turns a parent's death into SIGINT).
        command = guarded(
            [sys.executable, "-m", "flower_shard.flower.node.warm_superexec", *command[1:]]
        )
        proc = _subprocess.Popen(command, *args, **kwargs)
        threading.Thread(target=cls._watch, args=(proc, command, args, kwargs), daemon=True).start()
        return proc

    @classmethod
    def _watch(cls, proc, command, args, kwargs) -> None:
        early = 0
        started = _time.monotonic()
        while True:
            code = proc.wait()
            early = early + 1 if _time.monotonic() - started < cls.EARLY_EXIT_S else 0
            if early >= cls.CRASH_LOOP:
                logger.error(
                    "the SuperExec exited with %s within %.0f s of starting, %d times in a row "
                    "(see its error above): stopping this SuperNode",
                    code,
                    cls.EARLY_EXIT_S,
                    early,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return
            logger.warning(
                "the SuperExec (pid %d) exited with %s: starting a new one", proc.pid, code
            )
            _time.sleep(0.5 * early)
            started = _time.monotonic()
            proc = _subprocess.Popen(command, *args, **kwargs)


class _CappedSleep:
    """The ``time`` module, with ``sleep`` capped at the poll interval."""

    def __init__(self, cap: float):
        self.cap = cap

    def __getattr__(self, name):
        return getattr(_time, name)

    def sleep(self, seconds: float) -> None:
        _time.sleep(min(seconds, self.cap))


def main() -> int:
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    logs.setup(prefix="flower-shard supernode")  # the level: the node's, from the environment
    loop.time = _CappedSleep(float(os.environ.get(POLL_ENV, "0.1")))
    fast_object_pulls()
    if os.environ.get(WARM_ENV, "1") != "0":
        loop.subprocess = _WarmSuperExec()
    sys.argv[0] = "flower-supernode"
    return flower_supernode()


if __name__ == "__main__":
    sys.exit(main())
