"""The collective transport: the groups all-reduce their shards; Flower carries configs only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from logging import INFO, WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log

from flower_shard import protocol as P
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.exchange import Messenger
from flower_shard.flower.server.transports.base import Aggregate, Transport


def host_rendezvous(address: str, timeout_s: float):
    """The TCPStore where the groups meet (collective transport), listening on ``address`` only.

    torch's TCPStore listens on every interface whatever host it is given; a socket bound
    here to HOST:PORT and handed over (``master_listen_fd``) keeps it on the configured one.
    The store owns the socket from then on and closes it with itself.
    """
    import socket

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    listener = socket.create_server((host, int(port)))
    return dist.TCPStore(
        host,
        int(port),
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        timeout=timedelta(seconds=timeout_s),
    )


PROBE_TIMEOUT_S = 10.0
"""How long the probe of the dropped groups waits for their answers (a group that is up answers
at once: its ClientApp asks its control service)."""


class CollectiveTransport(Transport):
    """Each rank all-reduces only its own shard with the ranks holding the same shard in the
    other groups (NCCL on GPU, gloo on CPU), inside one cluster.

    The messages carry configuration only: each member's place among the round's members
    (``sync-rank`` of ``sync-size``) and a fresh rendezvous prefix per round, under which the
    groups form the round's cross-group process group through the TCPStore the ServerApp hosts
    at ``collective-address`` (:meth:`open`). The groups reply with metrics, their own sync's
    time and bytes among them; the server aggregates nothing and keeps rounds, membership,
    metrics and evaluation.

    On failure: a group that does not answer, or fails for another reason than an abandoned
    sync, is left out of the next rounds, and the others sync without it (their data parts
    stay where they were). A group that abandoned the sync (a peer died during it) kept its own
    weights and stays in. Before each round the dropped nodes still connected are probed (a
    QUERY with ``probe``: is the group up?); those that answer ready rejoin, and so does a node
    new to the run: the round's messages name them ``sync-joiners``, and before their inner
    steps every member takes part in the catch-up that gives them the global model and outer
    state (:mod:`~flower_shard.runtime.catch_up`). The groups hold the model: they evaluate it
    on request, and at the end one live group sends it (a QUERY message), checked like any
    reply.
    """

    name = P.COLLECTIVE
    groups_hold_model = True
    reply_fields = R.SYNC_FIELDS
    _store = None

    alive_last: frozenset[int] = frozenset()
    """The nodes whose group was alive at the end of the last round (held the global model)."""
    joiners: tuple[int, ...] = ()
    """The sync ranks of this round's members that catch up before training."""

    def admit(self, messenger: Messenger) -> None:
        """Probe the dropped nodes that are still connected; those whose group is up rejoin."""
        candidates = sorted(self.dropped & set(messenger.node_ids()))
        if not candidates:
            return
        probe = Messenger(messenger.grid, PROBE_TIMEOUT_S, messenger.poll_interval)
        config = ConfigRecord({P.RUN_ID: messenger.run_id, P.PROBE: 1})
        messages = [
            Message(RecordDict({P.CONFIG: config}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in candidates
        ]
        for reply in probe.send_and_receive(messages).replies:
            node = reply.metadata.src_node_id
            ready = not reply.has_error() and P.METRICS in reply.content
            if ready and reply.content[P.METRICS].get(P.H_READY) == 1 and node in self.dropped:
                self.dropped.discard(node)
                log(INFO, "node %s: its group is up again; it rejoins through a catch-up", node)

    def seat(self, members: list[int]) -> None:
        """Joiners: the members that did not end the last round alive, as long as one did."""
        held = [n in self.alive_last for n in members]
        self.joiners = tuple(i for i, h in enumerate(held) if not h) if any(held) else ()

    def open(self) -> None:
        self._store = host_rendezvous(self.fed.collective_address, self.fed.round_timeout)

    def close(self) -> None:
        self._store = None  # the store closes its socket with itself

    def node_config(
        self, server_round: int, run_id: int, rank: int, size: int, group: int = 0
    ) -> dict:
        out = {
            P.SYNC_RANK: rank,
            P.SYNC_SIZE: size,
            P.COLLECTIVE_PREFIX: f"run{run_id}/round{server_round}",
        }
        if self.joiners:
            out[P.SYNC_JOINERS] = ",".join(str(r) for r in self.joiners)
        return out

    def observe(
        self, server_round: int, asked: Iterable[int], answered: Mapping[int, Message]
    ) -> None:
        """Leave out of later rounds every group that did not answer, or failed for another
        reason than an abandoned sync (a group that abandoned the sync is alive)."""
        alive = {
            node
            for node, r in answered.items()
            if not r.has_error() or P.SYNC_ABANDONED in str(r.error.reason)
        }
        self.alive_last = frozenset(alive)
        dead = set(asked) - alive
        if dead:
            self.dropped |= dead
            log(
                WARNING,
                "round %s: group(s) of node(s) %s failed; the next rounds sync without them",
                server_round,
                sorted(dead),
            )

    def aggregate(self, server_round: int, ok: list[R.TrainReply], commit: bool) -> Aggregate:
        """Nothing to combine: the groups synced; their slowest sync is the round's."""
        return Aggregate(
            None,
            max((r.outer_sync_s for r in ok), default=0.0),
            int(max((r.outer_sync_bytes for r in ok), default=0)),
        )

    def final_weights(self, messenger: Messenger) -> dict[str, np.ndarray] | None:
        """The model the groups hold after the last sync, from the first live group that
        delivers valid weights (all hold the same average)."""
        for node in self.members(messenger.node_ids()):
            msg = Message(
                content=RecordDict({P.CONFIG: ConfigRecord({P.RUN_ID: messenger.run_id})}),
                message_type=MessageType.QUERY,
                dst_node_id=node,
            )
            replies = messenger.send_and_receive([msg]).replies
            try:
                if not replies:
                    raise R.Rejected("no reply")
                return R.named_weights(R.reply_content(replies[0]), self.spec)
            except Exception as exc:  # one group's bad answer: ask the next
                log(WARNING, "final weights: node %s: %s", node, exc)
        return None
