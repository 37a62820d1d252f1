"""One aggregator process: the data plane's gRPC service over an :class:`AggregatorState`.

Three calls (generic handlers, raw bytes, no generated code):

- ``Upload`` (a rank's stream): an opening JSON header (run, round, group, rank, token, the
  group's token weight, compression), then one frame per chunk; answered with a JSON summary.
  A stream with a wrong or replayed token, for a round that is not open, or from a group already
  rejected is refused at once; a bad frame rejects the group (all its ranks' frames, here) and
  ends the stream with the reason, and so does a stream the rank withdraws (another aggregator
  refused it; an upload whose stream had ended is withdrawn by a stream of the mark alone) or
  that breaks off (the rank died: nothing resends it). Frames are read
  one at a time as gRPC delivers them (its flow control holds a fast sender back), so memory
  does not follow the sender's pace.
- ``Download`` (a rank's request): JSON with the rank's token, the element ranges of its shard
  and the round of its last global model; answered with a JSON header (full snapshot, delta,
  or nothing new) and a stream of frames. A rank that *follows* the open round gets each
  parameter's new values as soon as the round's groups have all sent it (:mod:`.pipeline`).
  The ServerApp, with the control token, may download any range at any time (the final model).
- ``Control`` (the ServerApp): JSON commands carrying the control token (configure, begin,
  status, commit, save, load, shutdown).

It listens on exactly the address it is given, with TLS unless started insecure on purpose,
and writes a line per finished stream to ``WORK_DIR/streams.jsonl`` (:mod:`.streamlog`).

    python -m flower_shard.dataplane.aggregator --listen HOST:PORT --secret-file FILE
        --work-dir DIR [--tls-cert CERT --tls-key KEY | --insecure]
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

from flower_shard import logs
from flower_shard.config import choices as C
from flower_shard.dataplane import control, tickets, wire
from flower_shard.dataplane.pipeline import Superseded
from flower_shard.dataplane.streamlog import StreamLog

log = logging.getLogger(__name__)
MAX_STREAMS = 512  # concurrent calls, one thread each: beyond this, calls are refused
MAX_FOLLOWERS = 128  # of which follow a round (they wait for uploads: these must find threads)


class DataPlaneService:
    """The handlers; :attr:`state` is set by the ServerApp's ``configure`` command."""

    def __init__(self, secret: str, work_dir: Path):
        self.secret, self.work_dir = secret, work_dir
        self.state = None
        self.run = None
        self.stopped = threading.Event()
        self.followers = threading.BoundedSemaphore(MAX_FOLLOWERS)
        self.streams = StreamLog(work_dir)
        """A line per finished stream (:mod:`.streamlog`)."""

    # -- uplink --------------------------------------------------------------------------

    def upload(self, frames, context) -> bytes:
        record = self.streams.open("upload", context.peer())
        reply = {"ok": False, "reason": "the handler failed"}
        try:
            reply = self._upload(frames, record)
        finally:
            record["outcome"] = "ok" if reply["ok"] else reply["reason"]
            self.streams.close(record)
        return wire.to_json(reply)

    def _upload(self, frames, record: dict) -> dict:
        try:
            head = wire.from_json(next(frames))
            run, rnd = str(head["run"]), int(head["round"])
            group, rank = int(head["group"]), int(head["rank"])
        except (StopIteration, ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "reason": f"malformed stream header ({exc})"}
        record.update(run=run, round=rnd, group=group, rank=rank)
        reason = self._admit(run, rnd, group, rank, head.get("token", ""))
        if reason:
            log.warning("refused a stream of group %s rank %s: %s", group, rank, reason)
            return {"ok": False, "reason": reason}
        spool = self.state.spool(group, rnd)
        if spool is None:
            return {"ok": False, "reason": f"round {rnd} is committed or over"}
        reason = spool.rejected or self.state.declare(spool, _weight(head.get("weight")))
        if head.get("compression") != self.state.uplink:
            reason = (
                reason or f"compression {head.get('compression')!r}, expected {self.state.uplink!r}"
            )
        if reason is None:
            reason = self._receive(frames, spool, record)
        if reason:
            self.state.reject(spool, f"rank {rank}: {reason}")
            log.warning("round %s: rejected group %s: rank %s: %s", rnd, group, rank, reason)
            return {"ok": False, "reason": reason}
        return {"ok": True, "frames": record["frames"], "complete": spool.complete}

    @staticmethod
    def _receive(frames, spool, record: dict) -> str | None:
        """Add the stream's chunks to ``spool`` up to its end mark: why the upload is
        dropped, or None."""
        count = record["frames"] = 0
        try:
            for frame in frames:
                if frame == wire.END:
                    return None
                if frame == wire.WITHDRAW:
                    return "the rank withdrew its upload (another aggregator refused it)"
                record["bytes"] += len(frame)
                reason = spool.add(frame)
                if reason:
                    return reason
                count = record["frames"] = count + 1
        except _rpc_error():  # cancelled, or the rank is gone: its upload stays incomplete
            return f"the stream broke off after {count} chunks"
        return f"the stream broke off after {count} chunks (it ended without its end mark)"

    def _admit(self, run: str, rnd: int, group: int, rank: int, token: str) -> str | None:
        if self.state is None:
            return "the aggregator is not configured yet"
        if run != self.run or rnd != self.state.open_round:
            return f"round {rnd} of run {run!r} is not open for uploads"
        if not tickets.valid(self.secret, run, rnd, group, rank, token):
            return "a wrong token for this run, round, group and rank"
        return None

    # -- downlink ------------------------------------------------------------------------

    def download(self, request: bytes, context):
        try:
            req = wire.from_json(request)
            run, rnd = str(req["run"]), int(req["round"])
            group, rank = int(req["group"]), int(req["rank"])
            ranges = [(int(p), int(a), int(b)) for p, a, b in req["ranges"]]
            str(req["token"])
            have = int(req.get("have_round", -1))
            follow, provisional = bool(req.get("follow")), bool(req.get("provisional"))
        except (ValueError, KeyError, TypeError) as exc:
            context.abort(_invalid(), f"malformed download request ({exc})")
        server = hmac.compare_digest(str(req.get("token", "")), tickets.control_token(self.secret))
        state = self.state
        if state is None or (not server and (run != self.run or rnd != state.open_round)):
            context.abort(_denied(), f"round {rnd} of run {run!r} is not open")
        if not server and not tickets.valid(self.secret, run, rnd, group, rank, req["token"]):
            context.abort(_denied(), "a wrong token for this run, round, group and rank")
        if follow:
            mode = state.follow_mode(rnd, have, provisional)
        else:
            mode = state.mode(have, provisional)
        kind = state.downlink if mode == "delta" else C.NO_COMPRESSION
        yield wire.to_json(
            {
                "mode": mode,
                "kind": kind,
                "scale_chunk": state.scale_chunk,
                "round": rnd if follow else state.round,
            }
        )
        if follow and not self.followers.acquire(blocking=False):
            context.abort(
                _aborted(), f"{MAX_FOLLOWERS} ranks follow already; pull after the commit"
            )
        record = self.streams.open("follow" if follow else "download", context.peer())
        record.update(run=run, round=rnd, group=group, rank=rank)
        record["outcome"] = "cut"  # unless every range went out
        try:
            for param, start, stop in ranges:
                if follow:
                    timeout = state.follow_timeout
                    frames = state.pipe.follow(
                        rnd, param, start, stop, mode, timeout, context.is_active
                    )
                else:
                    frames = state.frames(param, start, stop, mode)
                yield from _counted(frames, record)
            record["outcome"] = "ok"
        except ValueError as exc:
            record["outcome"] = str(exc)
            context.abort(_invalid(), str(exc))
        except Superseded as exc:
            record["outcome"] = str(exc)
            context.abort(_aborted(), str(exc))
        finally:
            if follow:
                self.followers.release()
            self.streams.close(record)

    # -- the ServerApp -------------------------------------------------------------------

    def control(self, request: bytes, context) -> bytes:
        try:
            return wire.to_json(control.handle(self, wire.from_json(request)))
        except control.Refused as exc:
            context.abort(_denied(), str(exc))
        except (ValueError, KeyError, TypeError) as exc:
            return wire.to_json({"ok": False, "reason": f"{type(exc).__name__}: {exc}"})


def _counted(frames, record: dict):
    """``frames``, counted into the stream's log record as they go out; a cancelled call
    closes them at once (as ``yield from`` them would)."""
    try:
        for frame in frames:
            record["frames"] += 1
            record["bytes"] += len(frame)
            yield frame
    finally:
        frames.close()


def _weight(value) -> float:
    """A declared weight as a float; NaN for anything else (refused when declared)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float64: refused as not finite
        return float("inf")


def _rpc_error():
    import grpc

    return grpc.RpcError


def _invalid():
    import grpc

    return grpc.StatusCode.INVALID_ARGUMENT


def _aborted():
    import grpc

    return grpc.StatusCode.ABORTED


def _denied():
    import grpc

    return grpc.StatusCode.PERMISSION_DENIED


def serve(listen: str, secret: str, work_dir: Path, tls: tuple[bytes, bytes] | None) -> tuple:
    """Start the service on exactly ``listen``; returns (grpc server, service)."""
    import grpc

    service = DataPlaneService(secret, work_dir)
    handlers = {
        wire.UPLOAD: grpc.stream_unary_rpc_method_handler(service.upload),
        wire.DOWNLOAD: grpc.unary_stream_rpc_method_handler(service.download),
        wire.CONTROL: grpc.unary_unary_rpc_method_handler(service.control),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_STREAMS),
        options=wire.GRPC_OPTIONS,
        maximum_concurrent_rpcs=MAX_STREAMS,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, grpc.ssl_server_credentials([tls]))
    if port == 0:
        raise RuntimeError(f"the aggregator cannot listen on {listen}")
    server.start()
    return server, service


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flower_shard.dataplane.aggregator")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (only there)")
    p.add_argument("--secret-file", required=True, help="the run secret (hex), owner-only file")
    p.add_argument("--work-dir", required=True, help="spools and checkpoints of this aggregator")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--insecure", action="store_true", help="no TLS (loopback tests only)")
    args = p.parse_args(argv)
    logs.setup(prefix="flower-shard aggregator")
    if not args.insecure and not (args.tls_cert and args.tls_key):
        print("flower-shard aggregator: error: give --tls-cert and --tls-key, or --insecure")
        return 2
    tls = None
    if not args.insecure:
        tls = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())
    secret = Path(args.secret_file).read_text().strip()
    server, service = serve(args.listen, secret, Path(args.work_dir), tls)
    log.info("listening on %s (%s)", args.listen, "TLS" if tls else "insecure")
    signal.signal(signal.SIGTERM, lambda *_: service.stopped.set())
    service.stopped.wait()
    server.stop(grace=2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
