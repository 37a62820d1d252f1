"""CPU threads per rank: the ranks of a host share its cores, one share each.

Oversubscription (every rank's OpenMP pool sized to all cores) slows every rank down, so each
of the ``local_ranks`` ranks on a host gets ``cores // local_ranks`` threads (at least one).
The launchers export it as ``OMP_NUM_THREADS`` (unless the user set it); the runtime sets
torch's intra-op pool from it. A pure leaf module: no imports from flower_shard.
"""

from __future__ import annotations

import os

THREADS_ENV = "OMP_NUM_THREADS"


def threads_per_rank(local_ranks: int) -> int:
    """This host's cores divided among its ``local_ranks`` ranks, at least one thread each."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def with_threads(env: dict[str, str], local_ranks: int) -> dict[str, str]:
    """``env`` with ``OMP_NUM_THREADS`` set to :func:`threads_per_rank` unless already set."""
    env.setdefault(THREADS_ENV, str(threads_per_rank(local_ranks)))
    return env
