"""The flower transport's compressed downlink: the groups get the change of the model they
hold, bf16 or int8, instead of the whole float32 model every round.

The server keeps ``sent``: the model the groups hold, exactly as they rebuild it (float32, the
flat sorted-name order of :func:`~flower_shard.flower.wire.pack`), and its version. Each round
(:meth:`Downlink.advance`) it compresses ``global - sent`` once for every group and adds the
decoded payload to ``sent``, as each group adds it to its own copy. That is error feedback by
construction: what compression loses stays in ``global - sent`` and goes out in later rounds,
so no separate residual is kept (one would count the loss twice). A group whose copy is of
the previous version gets the payload (:data:`~flower_shard.protocol.DOWNLINK_BASE` names that
version); any other group (new, restarted, rejoining after a missed round) gets ``sent`` as a
float32 snapshot. A group holds the new version once its reply of the round passed the reply
checks (:meth:`acknowledge`): a group that failed, timed out or lost its copy gets the snapshot
next. The groups train from ``sent``, so their updates are measured from it
(:meth:`reference`).

Memory: ``sent`` (M) and one payload (M/2 or M/4) besides the server's global model.
On failure: nothing here raises after construction; a group with the wrong version refuses
the delta before it trains, and gets a snapshot the round after.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from flower_shard import protocol as P
from flower_shard.flower.wire import describe, pack, unflatten_flat
from flower_shard.runtime import compression as Z


class Downlink:
    """What the groups hold of the global model, and what each one is sent next.

    Parameters
    ----------
    kind, chunk
        The compression (``bf16`` or ``int8``) and int8's values per scale.
    initial
        The first global weights (what version 0 is).
    """

    def __init__(self, kind: str, chunk: int, initial: dict[str, np.ndarray]):
        self.kind, self.chunk = kind, chunk
        self.spec = describe(initial)
        self.names = sorted(initial)
        self.sent = torch.from_numpy(pack(initial))
        """The model the groups hold (flat float32, sorted names): version :attr:`version`."""
        self.version = 0
        self.holds: dict[int, int] = {}
        """Node -> the version it holds (its last acknowledged round's)."""
        self._delta: ArrayRecord | None = None
        self._snapshot: ArrayRecord | None = None

    def advance(self, global_arrays: dict[str, np.ndarray]) -> None:
        """A round begins: compress ``global - sent`` and move ``sent`` by what it decodes to."""
        change = torch.from_numpy(pack(global_arrays)) - self.sent
        payload = Z.compress(change, self.kind, self.chunk)
        self.sent += Z.decompress(payload, self.kind, self.chunk)
        self.version += 1
        self._delta = ArrayRecord({k: Array(v.numpy()) for k, v in payload.items()})
        self._snapshot = None  # made when a group needs one, once per round

    def records(self, node: int) -> tuple[ArrayRecord, dict]:
        """The arrays and config keys of ``node``'s message this round."""
        if self.holds.get(node) == self.version - 1:  # holds only versions >= 1
            keys = {P.DOWNLINK: self.kind, P.DOWNLINK_BASE: self.version - 1}
            return self._delta, keys | {P.DOWNLINK_VERSION: self.version}
        if self._snapshot is None:
            self._snapshot = ArrayRecord({P.PACKED: Array(self.sent.numpy())})
        return self._snapshot, {P.DOWNLINK_VERSION: self.version}

    def acknowledge(self, nodes) -> None:
        """The nodes whose replies of this round passed the checks: they hold this version;
        every other node gets a snapshot next."""
        self.holds = {int(n): self.version for n in nodes}

    def reference(self) -> dict[str, np.ndarray]:
        """``sent`` by name (views): where the groups started this round's training."""
        return unflatten_flat(self.sent.numpy(), self.spec, self.names)

    def state_dict(self) -> dict:
        """For the server checkpoint: ``sent`` and its version (who holds it is not kept: after
        a resume every group gets a snapshot of exactly ``sent``)."""
        return {"downlink_sent": self.sent.clone(), "downlink_version": torch.tensor(self.version)}

    def load_state_dict(self, state: dict) -> None:
        self.sent.copy_(state["downlink_sent"])
        self.version = int(state["downlink_version"])
        self.holds = {}
