"""The callers' side of the data plane: a rank's uplink and downlink, the ServerApp's control.

A rank's pieces are ``(parameter index, first element, float32 values)``: the element ranges its
shard holds (:func:`~.layout.local_range`). The uplink cuts them into chunks of at most
:data:`~.wire.CHUNK_VALUES` values and streams each aggregator the chunks of the parameters it
owns, all aggregators at once (one thread each). With a compressed uplink the rank keeps what
compression lost and adds it to the next round's update (error feedback, per rank).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np

from flower_shard.config import choices as C
from flower_shard.dataplane import tickets, wire
from flower_shard.dataplane.layout import Layout

log = logging.getLogger(__name__)

# (parameter index, first element, values): values is a float32 array, or anything with
# ``.size`` whose slices are float32 arrays (the exchange benchmark's synthetic shards).
Piece = tuple[int, int, np.ndarray]


class DataPlaneError(RuntimeError):
    """An aggregator refused a stream or a download, or could not be reached."""


def channel(address: str, root_certificates: bytes | None, tls: bool):
    """A gRPC channel to an aggregator (TLS with ``root_certificates`` when ``tls``)."""
    import grpc

    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(address, creds, options=wire.GRPC_OPTIONS)
    return grpc.insecure_channel(address, options=wire.GRPC_OPTIONS)


@dataclass
class UplinkEncoder:
    """Quantizes a rank's updates chunk by chunk, carrying each round's loss to the next."""

    kind: str
    scale_chunk: int
    feedback: bool = True
    residual: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    sent_bytes: int = 0
    """Bytes of the frames made so far (the caller zeroes it per round)."""
    on_frame: object = None
    """Called before each frame is made (fault injection in tests and drills); None: nothing."""

    def frames(self, param: int, start: int, values: np.ndarray):
        """Frames for ``values`` of ``param`` from ``start`` (chunked, quantized)."""
        for a in range(0, values.size, wire.CHUNK_VALUES):
            chunk = values[a : a + wire.CHUNK_VALUES]
            if self.on_frame is not None:
                self.on_frame()
            key = (param, start + a)
            if self.kind != C.NO_COMPRESSION and self.feedback and key in self.residual:
                chunk = chunk + self.residual[key]
            scales, data = wire.quantize(chunk, start + a, self.kind, self.scale_chunk)
            if self.kind != C.NO_COMPRESSION and self.feedback:
                lost = chunk - wire.dequantize(scales, data, start + a, self.kind, self.scale_chunk)
                self.residual[key] = lost if np.isfinite(lost).all() else np.zeros_like(lost)
            frame = wire.encode_chunk(
                param, start + a, None, self.kind, self.scale_chunk, (scales, data)
            )
            self.sent_bytes += len(frame)
            yield frame


class RankLink:
    """One rank's uplink and downlink for one round (see the module docstring)."""

    def __init__(self, ticket: tickets.Ticket, rank: int, root_certificates: bytes | None = None):
        self.ticket, self.rank = ticket, rank
        self.token = tickets.rank_token(ticket.token, rank)
        self.channels = [channel(a, root_certificates, ticket.tls) for a in ticket.addresses]

    def _ident(self) -> dict:
        t = self.ticket
        return {
            "run": t.run,
            "round": t.round,
            "group": t.group,
            "rank": self.rank,
            "token": self.token,
        }

    def upload(
        self, pieces: list[Piece], layout: Layout, weight: float, encoder: UplinkEncoder
    ) -> list[dict]:
        """Stream ``pieces`` to their owners; each aggregator's summary. Raises
        :class:`DataPlaneError` when an aggregator refused the stream or could not be reached;
        this rank's streams to the others that are still sending then end with
        :data:`~.wire.WITHDRAW`, and those that had already ended are withdrawn by a stream of
        the mark alone: every aggregator drops the group's upload (all its ranks'), so the
        pipelined commit does not wait for it anywhere."""
        head = self._ident() | {"weight": weight, "compression": encoder.kind}
        by_owner: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_owner.setdefault(layout.params[piece[0]].owner, []).append(piece)

        failed: list[str] = []

        def send(owner: int) -> dict:
            def frames():
                yield wire.to_json(head)
                for param, start, values in by_owner.get(owner, []):
                    for frame in encoder.frames(param, start, values):
                        if failed:  # withdrawn, not cancelled: a cancel may never reach it
                            yield wire.WITHDRAW
                            return
                        yield frame
                yield wire.END

            call = self.channels[owner].stream_unary(f"/{wire.SERVICE}/{wire.UPLOAD}")
            address = self.ticket.addresses[owner]
            try:
                summary = wire.from_json(call(frames()))
                error = None if summary.get("ok") else f"{address} refused the upload: "
                error = error and error + str(summary.get("reason"))
            except _rpc_error() as exc:
                summary, error = {"ok": False}, f"{address}: {exc.code().name} {exc.details()}"
            if error and not failed:  # the streams to the others end with WITHDRAW
                failed.append(f"aggregator {error}")
            return summary

        with futures.ThreadPoolExecutor(max(1, len(self.channels))) as pool:
            summaries = list(pool.map(send, range(len(self.channels))))
        if failed:
            # a stream that ended before the refusal was known is withdrawn after the fact
            self._withdraw(head, [o for o, s in enumerate(summaries) if s.get("ok")])
            raise DataPlaneError(failed[0])
        return summaries

    def _withdraw(self, head: dict, owners: list[int]) -> None:
        """Drop this group's upload at ``owners`` (a stream of the header and the withdraw
        mark), so the aggregators agree and none waits for the group (best effort: one
        that cannot be reached, or whose round is over, has nothing to drop)."""
        for owner in owners:
            call = self.channels[owner].stream_unary(f"/{wire.SERVICE}/{wire.UPLOAD}")
            try:
                call(iter([wire.to_json(head), wire.WITHDRAW]), timeout=60)
            except _rpc_error():
                pass

    def download(
        self,
        ranges: list[tuple[int, int, int]],
        layout: Layout,
        have_round: int,
        sink=None,
        *,
        follow: bool = False,
        provisional: bool = False,
    ) -> tuple[str, int, dict[tuple[int, int], np.ndarray]]:
        """``(mode, global round, {(param, start): values})`` for the element ranges
        ``(param, start, stop)``: ``full`` values, or the ``delta`` since round ``have_round``.

        ``sink(mode, param, start, values)``, when given, takes each chunk as it arrives (to
        copy it into place) and the dict stays empty: nothing of the model is held twice.
        ``follow``: the ticket's round as its parameters are folded (:mod:`.pipeline`);
        ``provisional``: ``have_round`` was followed and may not have been kept."""
        by_owner: dict[int, list] = {}
        for r in ranges:
            by_owner.setdefault(layout.params[r[0]].owner, []).append(list(r))
        fetch = _Fetches(self, have_round, sink, follow=follow, provisional=provisional)
        with futures.ThreadPoolExecutor(max(1, len(by_owner))) as pool:
            results = list(pool.map(lambda o: fetch(o, by_owner[o]), sorted(by_owner)))
        if fetch.failed:
            raise DataPlaneError(fetch.failed[0])
        modes = {(h["mode"], h["round"]) for h, _ in results}
        if len(modes) != 1:
            raise DataPlaneError(f"aggregators answered in different states: {sorted(modes)}")
        (mode, rnd), values = modes.pop(), {}
        for _, out in results:
            values |= out
        return mode, rnd, values

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


class _Fetches:
    """One download's streams, one per aggregator: the first that fails ends the others at
    once (a follower voided by one aggregator need not wait for the rest)."""

    def __init__(self, link: RankLink, have_round: int, sink, **flags):
        self.link, self.have_round, self.sink, self.flags = link, have_round, sink, flags
        self.streams, self.failed = {}, []
        self.lock = threading.Lock()

    def __call__(self, owner: int, ranges: list) -> tuple[dict | None, dict]:
        import grpc

        link = self.link
        req = link._ident() | {"ranges": ranges, "have_round": self.have_round} | self.flags
        call = link.channels[owner].unary_stream(f"/{wire.SERVICE}/{wire.DOWNLOAD}")
        out = {}
        try:
            stream = call(wire.to_json(req))
            with self.lock:
                self.streams[owner] = stream
                if self.failed:
                    stream.cancel()
            head = wire.from_json(next(stream))
            for frame in stream:
                param, start, _ = wire.decode_header(frame)
                values = wire.decode_values(frame, head["kind"], head["scale_chunk"])
                if self.sink is None:
                    out[(param, start)] = values.copy()  # not a view of the frame
                else:
                    self.sink(head["mode"], param, start, values)
        except grpc.RpcError as exc:
            with self.lock:
                if not self.failed:  # the cause, not the cancellations it led to
                    address = link.ticket.addresses[owner]
                    self.failed.append(
                        f"aggregator {address}: download: {exc.code().name} {exc.details()}"
                    )
                    for other in self.streams.values():
                        other.cancel()
            return None, out
        return head, out


def _rpc_error():
    import grpc

    return grpc.RpcError


class ControlClient:
    """The ServerApp's calls to one aggregator."""

    def __init__(self, address: str, secret: str, root_certificates: bytes | None, tls: bool):
        self.address = address
        self.token = tickets.control_token(secret)
        self._channel = channel(address, root_certificates, tls)
        self._call = self._channel.unary_unary(f"/{wire.SERVICE}/{wire.CONTROL}")

    def __call__(self, op: str, timeout: float = 3600.0, **kw) -> dict:
        import grpc

        try:
            reply = wire.from_json(
                self._call(wire.to_json({"op": op, "token": self.token, **kw}), timeout=timeout)
            )
        except grpc.RpcError as exc:
            raise DataPlaneError(
                f"aggregator {self.address}: {op}: {exc.code().name} {exc.details()}"
            ) from None
        if not reply.get("ok"):
            raise DataPlaneError(f"aggregator {self.address}: {op}: {reply.get('reason')}")
        return reply

    def close(self) -> None:
        self._channel.close()
