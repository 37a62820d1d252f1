"""``flower-supernode`` with a short idle poll: a round need not wait for Flower's 3 s sleeps.

Flower 1.42's SuperNode sleeps 3 s after every pull that found no message (and 0.5 s while it
waits for a reply), so each round of a deployment pays up to ~3.5 s of pure waiting on top of
the training. This entry point runs the stock SuperNode with those sleeps capped at
``FLOWER_SHARD_SUPERNODE_POLL`` seconds (default 0.1). The cost is more pull requests to the
SuperLink (10 per second per idle node at 0.1 s): set 3 to get Flower's own behaviour.

    python -m flower_shard.fast_supernode [flower-supernode arguments]
"""

from __future__ import annotations

import os
import sys
import time as _time

POLL_ENV = "FLOWER_SHARD_SUPERNODE_POLL"


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

    loop.time = _CappedSleep(float(os.environ.get(POLL_ENV, "0.1")))
    sys.argv[0] = "flower-supernode"
    return flower_supernode()


if __name__ == "__main__":
    sys.exit(main())
