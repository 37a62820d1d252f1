"""The streaming transport, group side: each round, every rank pulls the global model from the
aggregators into its shards, trains, and pushes its pseudo-gradient; only the ticket and the
metrics travel through Flower.

The round's ticket (:class:`~flower_shard.dataplane.tickets.Ticket`: the aggregators'
addresses and this group's token for the round) arrives in the train and evaluate messages.
The layout is computed here from the model's own parameters and the number of aggregators (the
server computes the same), so no weights or shapes travel with it.

On failure: a rank that cannot reach an aggregator, or whose stream an aggregator refuses,
makes the whole group answer with an error (all ranks vote over the group's control group, so
none of them reports success alone); the server leaves the group out of the round, and the
group pulls a full snapshot next time (its view is no longer the aggregators').
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard.config import TrainConfig
from flower_shard.dataplane import tickets
from flower_shard.dataplane.client import DataPlaneError, RankLink
from flower_shard.dataplane.layout import Layout
from flower_shard.dataplane.rank import RankExchange

log = logging.getLogger(__name__)


class StreamExchange:
    """One rank's link to the data plane for the run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, model, replicate_pg, root_certificates: str | None):
        self.cfg, self.model, self.replicate_pg = cfg, model, replicate_pg
        self.root = Path(root_certificates).read_bytes() if root_certificates else None
        self.rank = dist.get_rank()
        self.exchange: RankExchange | None = None
        self.sent_bytes = 0
        self._pusher: threading.Thread | None = None
        self._failure: str | None = None

    def _link(self, config: dict) -> RankLink:
        ticket = tickets.Ticket.from_config(json.loads(str(config[P.TICKET])))
        if self.exchange is None or self.exchange.layout.aggregators != len(ticket.addresses):
            shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
            layout = Layout.build(shapes, len(ticket.addresses))
            if ticket.layout and layout.digest() != ticket.layout:
                raise DataPlaneError(
                    "this group's model is cut differently from the server's (another model, "
                    "tokenizer or vocabulary): check the node's --data and the run's tokenizer"
                )
            cfg = self.cfg
            self.exchange = RankExchange(
                self.model,
                layout,
                cfg.compression,
                cfg.compression_chunk,
                cfg.error_feedback,
                self.replicate_pg,
            )
        return RankLink(ticket, self.rank, self.root)

    def pull(self, config: dict, control) -> float:
        """Every rank: load the round's global model; the seconds it took."""
        return self._download(config, control, lambda link: self.exchange.pull(link))

    def _download(self, config: dict, control, action) -> float:
        """Every rank: ``action`` with the round's link (None on a replica that does not talk
        to the aggregators), voted over the group; the seconds it took."""
        start = time.perf_counter()

        def download() -> None:
            link = self._link(config)
            try:
                action(link if self.exchange.leader else None)
            finally:
                link.close()

        _vote(_attempt(download), control, "pull")
        return time.perf_counter() - start

    def push(self, config: dict, weight: int, control, on_frame=None) -> tuple[float, int]:
        """Every rank: stream the round's pseudo-gradient; (seconds, bytes this rank sent).
        ``on_frame`` is called before each chunk (fault injection)."""
        start = time.perf_counter()

        def push() -> None:
            link = self._link(config)
            if link.ticket.follow:  # the new values come back while the update goes out
                self.exchange.follow(self._link(config))
            self.exchange.encoder.sent_bytes = 0
            self.exchange.encoder.on_frame = on_frame
            try:
                self.exchange.push(link, float(weight))
            finally:
                link.close()

        _vote(_attempt(push), control, "push")
        return time.perf_counter() - start, self.exchange.encoder.sent_bytes

    # -- overlapped (flower_shard.flower.group.overlap) ---------------------------------------

    def confirm(self, config: dict, control) -> float:
        """Every rank: the view to the last committed global model (the shards keep training
        their own); the seconds it took."""
        return self._download(config, control, lambda link: self.exchange.confirm(link))

    def start_push(self, config: dict, weight: int, on_frame=None) -> None:
        """Every rank: stream ``view - sent`` (the snapshot) in the background, following the
        round; :meth:`finish_push` waits for it."""
        self._failure = None
        self.exchange.encoder.sent_bytes = 0
        self.exchange.encoder.on_frame = on_frame

        def push() -> None:
            link = self._link(config)
            try:
                self.exchange.follow(self._link(config))
                self.exchange.push(link, float(weight), snapshot=True)
            finally:
                link.close()

        def run() -> None:
            try:
                self._failure = _attempt(push)
            except Exception as exc:  # noqa: BLE001 - any failure is the group's, voted on
                self._failure = f"{type(exc).__name__}: {exc}"

        self._pusher = threading.Thread(target=run, name="overlapped-push", daemon=True)
        self._pusher.start()

    def finish_push(self, control) -> tuple[float, int]:
        """Every rank: wait for :meth:`start_push`; (seconds waited, bytes this rank sent).
        Raises :class:`DataPlaneError` on every rank if any rank's push failed."""
        start = time.perf_counter()
        self.join_push()
        _vote(self._failure, control, "push")
        return time.perf_counter() - start, self.exchange.encoder.sent_bytes

    def join_push(self) -> None:
        """Wait for a background push, if one runs (its failure stays in ``_failure``)."""
        if self._pusher is not None:
            self._pusher.join()
            self._pusher = None


def _attempt(action) -> str | None:
    try:
        action()
    except DataPlaneError as exc:
        return str(exc)
    return None


def _vote(failure: str | None, control, what: str) -> None:
    """All ranks of the group learn whether any failed; raise :class:`DataPlaneError` on all."""
    flag = torch.tensor([0.0 if failure is None else 1.0])
    dist.all_reduce(flag, group=control)
    if flag.item() > 0:
        raise DataPlaneError(failure or f"another rank of this group failed its {what}")
