"""The long-lived group behind one Flower client: K torchrun ranks and a local control service.

Flower starts a fresh ClientApp process for every message, so the sharded model and the inner
optimizer cannot live there. They live here, in a torchrun job that outlives the messages. Rank 0
serves a small gRPC service (on a Unix socket in an owner-only directory, or on loopback) with
four calls: ``Health``, ``Train`` (load the global weights, run T steps, then either return
the full weights or average the shards with the other groups), ``Evaluate`` and ``GetWeights``.

Rank 0 turns each call into a command that it broadcasts to all ranks over a gloo control
group; every rank then runs the command collectively
(:class:`~flower_shard.flower.group.worker.GroupWorker`). Commands run one at a time, in order.

On failure: a call whose configuration is invalid is answered with an error and changes
nothing. A cross-group sync that fails is rolled back by the whole group, which answers with
an error and goes on. Any other exception in the middle of a collective command leaves the
ranks out of step, so the whole job exits (torchrun stops every rank) and whoever started it
restarts it.

Started by ``flower-shard node``: ``python -m flower_shard.launch.agent --nproc-per-node=K
--nnodes=1 --node-rank=0 --master-addr=127.0.0.1 --master-port=0 -m
flower_shard.flower.group.service --address unix:PATH --work-dir DIR`` (torchrun with its
store on loopback; each rank dies with it).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import torch.distributed as dist

from flower_shard import logs
from flower_shard import protocol as P
from flower_shard.config import ConfigError
from flower_shard.config.choices import AUTO, DEVICES
from flower_shard.flower import wire
from flower_shard.flower.group.abandon import Abandonment
from flower_shard.flower.group.worker import GroupWorker
from flower_shard.launch.guard import die_with_agent

log = logging.getLogger(__name__)

REPLY_GRACE_S = 0.5  # after a fatal error: time for the reply to leave before the job goes down


class ControlServer:
    """Rank 0's gRPC service: turns calls into commands for the rank-0 main loop.

    ``Health`` is answered from the gRPC thread (:attr:`status`); every other call waits in
    :attr:`commands` until the main loop has run it on all ranks and set its reply.
    """

    def __init__(self, address: str, abandonment: Abandonment | None = None):
        import grpc

        self.commands: queue.Queue = queue.Queue()
        self.abandonment = abandonment
        self.running: tuple[int, dict] | None = None
        """The number and configuration of the Train command the ranks are running."""
        self.status = {P.H_READY: False, P.H_RANKS: dist.get_world_size(), P.H_STEP: 0}
        # Health is one small message; the calls that carry weights are streams of frames
        # (wire.frames): no gRPC message of the model's size, one copy of it here.
        handlers = {
            m: grpc.stream_stream_rpc_method_handler(self._handler(m))
            for m in P.METHODS
            if m != P.HEALTH
        }
        handlers[P.HEALTH] = grpc.unary_unary_rpc_method_handler(
            lambda request, context: wire.encode(self.status)
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=wire.GRPC_OPTIONS
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(P.SERVICE, handlers),)
        )
        # A Unix socket is created owner-only (umask 077 while it is bound): whoever can
        # connect to it can drive the group.
        previous = os.umask(0o077)
        try:
            if self.server.add_insecure_port(address) == 0 and not address.startswith("unix:"):
                raise RuntimeError(f"cannot bind the group control service to {address}")
            self.server.start()
        finally:
            os.umask(previous)
        if address.startswith("unix:"):
            os.chmod(address.removeprefix("unix:"), 0o600)

    def _handler(self, method: str):
        def handle(request: Iterator[bytes], context) -> Iterator[bytes]:
            try:
                header, arrays = wire.assemble(request)
            except ValueError as exc:
                yield from wire.frames({P.H_ERROR: f"bad request: {exc}"})
                return
            done: futures.Future = futures.Future()
            self.commands.put((method, header, arrays, done))
            del arrays  # the command holds them until it has run
            self._abandon_if_superseded(self.running, [(method, header)])
            reply_header, reply_arrays = done.result()
            yield from wire.frames(reply_header, reply_arrays)

        return handle

    def begin(self, number: int, command: dict) -> None:
        """Rank 0, before the ranks run ``command``: a Train may be abandoned from now on (by a
        call that is already queued, too)."""
        if command[P.H_METHOD] != P.TRAIN:
            return
        self.running = (number, command[P.H_CONFIG])
        with self.commands.mutex:
            queued = [(m, h) for m, h, _, _ in self.commands.queue]
        self._abandon_if_superseded(self.running, queued)

    def end(self) -> None:
        self.running = None

    def _abandon_if_superseded(self, running, calls) -> None:
        """Raise the running Train's abandon flag if one of ``calls`` belongs to a run that
        supersedes it (:func:`supersedes`)."""
        if running is None or self.abandonment is None:
            return
        number, config = running
        for method, header in calls:
            new = header.get(P.H_CONFIG)
            if (
                method in (P.TRAIN, P.EVALUATE)
                and isinstance(new, dict)
                and supersedes(new, config)
            ):
                log.warning(
                    "run %s's command arrived during a sync of run %s: the sync is abandoned",
                    new.get(P.RUN_ID),
                    config.get(P.RUN_ID),
                )
                self.abandonment.raise_for(number)
                return


def supersedes(new: dict, running: dict) -> bool:
    """Whether a call of run ``new`` makes the running command of run ``running`` pointless:
    another run that resumes after a later round (a resumed run supersedes the run it resumed,
    whose ServerApp died; a late message of that dead run never supersedes its successor)."""
    try:
        later = int(new.get(P.RESUME_ROUND, 0)) > int(running.get(P.RESUME_ROUND, 0))
    except (TypeError, ValueError):
        return False
    return later and new.get(P.RUN_ID) != running.get(P.RUN_ID)


def next_command(worker: GroupWorker, server: ControlServer):
    """Rank 0: the next call that passes the run-configuration check, as a command for every
    rank; a call that fails the check is answered at once and never reaches the other ranks.

    Returns (command, arrays, the future to answer).
    """
    while True:
        method, header, arrays, done = server.commands.get()
        command = {
            P.H_METHOD: method,
            P.H_CONFIG: header.get(P.H_CONFIG, {}),
            P.H_HAS_ARRAYS: bool(arrays),
        }
        if method == P.GET_WEIGHTS:
            return command, arrays, done
        refusal = worker.refusal(command[P.H_CONFIG])
        if refusal:  # answered here: the ranks never see it, the group goes on
            done.set_result(({P.H_ERROR: refusal}, {}))
            continue
        try:  # refuse a bad configuration before any rank acts on it
            worker.check(command[P.H_CONFIG])
        except (ConfigError, KeyError, ValueError, TypeError) as exc:
            done.set_result(({P.H_ERROR: f"bad run configuration: {exc}"}, {}))
            continue
        return command, arrays, done


def serve(args: argparse.Namespace) -> int:
    """Every rank: run the group's commands until the job is stopped."""
    work_dir = Path(args.work_dir)
    worker = GroupWorker(
        work_dir, args.data, args.device, args.dump_dir, args.fault_file, args.root_certificates
    )
    server = None
    if worker.rank == 0:
        server = ControlServer(args.address, worker.abandonment)
        server.status[P.H_READY] = True
        log.info("%d ranks serving %s", dist.get_world_size(), args.address)
    number = 0
    while True:
        command, arrays, done = None, {}, None
        if server is not None:
            command, arrays, done = next_command(worker, server)
            number += 1
            command[P.H_COMMAND] = number
            server.begin(number, command)
        box = [command]
        dist.broadcast_object_list(box, src=0, group=worker.control)
        try:
            reply = worker.execute(box[0], arrays)
        except BaseException as exc:
            if done is not None:
                done.set_result(({P.H_ERROR: f"group failed: {type(exc).__name__}: {exc}"}, {}))
                time.sleep(REPLY_GRACE_S)
            raise
        if server is not None:
            server.end()
        if done is not None:
            server.status[P.H_STEP] = worker.trainer.state.step if worker.trainer else 0
            done.set_result(reply)


def main(argv: list[str] | None = None) -> int:
    die_with_agent()  # a rank whose torchrun is gone could only hang in a collective
    p = argparse.ArgumentParser(prog="flower_shard.flower.group.service")
    p.add_argument("--address", required=True, help="unix:/path/group.sock or 127.0.0.1:PORT")
    p.add_argument("--work-dir", required=True, help="where the group keeps its prepared data")
    p.add_argument(
        "--data", default=None, help="this node's directory of text files or .jsonl / .parquet file"
    )
    p.add_argument("--device", default=AUTO, choices=DEVICES)
    p.add_argument("--dump-dir", default=None, help="debug: write the weights of every round")
    p.add_argument("--fault-file", default=None, help="fault injection (see flower.group.faults)")
    p.add_argument(
        "--root-certificates",
        default=None,
        help="the CA of the streaming transport's aggregators (the node's --root-certificates)",
    )
    args = p.parse_args(argv)
    logs.setup(prefix="flower-shard group")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
