"""Which data partition each group trains on, kept for the whole run whoever joins or leaves.

The training data is cut into P partitions for the run (``data-partitions``; 0 takes the number
of groups at the first round). Each node holds one partition, its *slot*, and every message it
gets says so (``group-index`` = the slot, ``num-groups`` = P). A group's data part, its data
position and its checkpoints (keyed by run, slot and P) therefore do not move when another
group joins or leaves: before, the slot was the node's index among the sorted node ids, so one
node joining mid-run shifted every other group onto different data and away from its
checkpoints.

How a node gets its slot, at the first round it takes part in:

1. a node that held one keeps it, also after being away (a restarted group, a node that was
   dropped and is back: its data part and its checkpoints are where it left them);
2. a new node takes the lowest slot no node has held;
3. with every slot given out, it takes over the slot of the node that has been away longest
   (not connected now; the partition is trained on from its start again);
4. with every slot held by a connected node, it waits outside the run (logged each round):
   start the run with a larger ``data-partitions`` to admit more groups.

The assignment is saved in the server checkpoint, so a resumed run gives every node its slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.common.logger import log

from flower_shard.errors import CheckpointError

PARTITIONS, SLOTS, SEEN = "partitions", "slots", "seen"
"""The keys of :meth:`DataSlots.state_dict` (the server checkpoint's JSON state)."""


@dataclass
class DataSlots:
    """Each node's data partition (see the module's docstring)."""

    partitions: int = 0
    """P, the run's number of data partitions; 0 until the first round fixes it."""
    slots: dict[int, int] = field(default_factory=dict)
    """Node id -> the slot it holds."""
    seen: dict[int, int] = field(default_factory=dict)
    """Node id -> the last round it took part in (who has been away longest)."""

    def assign(self, nodes: list[int], server_round: int) -> dict[int, int]:
        """The slot of each of ``nodes`` (the round's candidate members, connected now) that
        takes part in round ``server_round``; a node left without one waits (logged).
        Calling it again in the same round with the same nodes gives the same answer."""
        if not self.partitions:
            self.partitions = max(1, len(nodes))
            log(INFO, "data: %d partition(s) for the run, one per group", self.partitions)
        connected = set(nodes)
        for node in sorted(nodes):  # new nodes get free slots in node-id order
            if node not in self.slots:
                self._give(node, connected, server_round)
        out = {n: self.slots[n] for n in nodes if n in self.slots}
        for node in out:
            self.seen[node] = server_round
        waiting = [n for n in nodes if n not in out]
        if waiting:
            log(
                WARNING,
                "round %s: node(s) %s wait outside the run: all %d data partitions are held "
                "by connected groups; start the run with a larger data-partitions to admit more",
                server_round,
                waiting,
                self.partitions,
            )
        return out

    def _give(self, node: int, connected: set[int], server_round: int) -> None:
        held = set(self.slots.values())
        free = [s for s in range(self.partitions) if s not in held]
        if free:
            self.slots[node] = free[0]
            log(INFO, "round %s: node %s joins with data partition %d", server_round, node, free[0])
            return
        away = [n for n in self.slots if n not in connected]
        if not away:
            return
        gone = min(away, key=lambda n: (self.seen.get(n, 0), n))
        slot, last = self.slots.pop(gone), self.seen.pop(gone, None)
        self.slots[node] = slot
        log(
            WARNING,
            "round %s: node %s takes over data partition %d of node %s (last seen in round %s)",
            server_round,
            node,
            slot,
            gone,
            last,
        )

    def state_dict(self) -> dict:
        """JSON-able (node ids as strings: JSON object keys)."""
        return {
            PARTITIONS: self.partitions,
            SLOTS: {str(n): s for n, s in self.slots.items()},
            SEEN: {str(n): r for n, r in self.seen.items()},
        }

    @classmethod
    def from_state(cls, state: dict | None, partitions: int = 0) -> DataSlots:
        """From :meth:`state_dict` (None or empty: a run's first round, ``partitions`` P)."""
        if not state:
            return cls(partitions)
        try:
            out = cls(
                int(state[PARTITIONS]),
                {int(n): int(s) for n, s in state[SLOTS].items()},
                {int(n): int(r) for n, r in state[SEEN].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"data slots: malformed state ({exc!r})") from exc
        slots = list(out.slots.values())
        if out.partitions < 1 or len(set(slots)) != len(slots):
            raise CheckpointError(f"data slots: {out.partitions} partitions, slots {slots}")
        if any(not 0 <= s < out.partitions for s in slots):
            raise CheckpointError(f"data slots: a slot outside 0..{out.partitions - 1}: {slots}")
        return out
