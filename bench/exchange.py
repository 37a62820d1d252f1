"""Exchange only: the streaming data plane's real code paths on a large synthetic model, against
raw loopback TCP moving the same bytes, with every process's peak memory.

Beside raw TCP it times bare gRPC: the same connections streaming the same bytes in 4 MiB
messages through grpcio with nothing else done, the floor of any data plane written in Python
gRPC on the machine at hand.

A synthetic model of ``--size-gb`` float32 (parameters of 4096 x 4096) is owned by
``--aggregators`` aggregator processes. Each of G groups has K rank processes; per round every
rank downloads its shard of the global model (a full snapshot: float32), then streams its
synthetic pseudo-gradient (made chunk by chunk with the one subtraction a real rank does, so
the bench's ranks hold no model: the real group's memory is measured by the deployment
benchmarks), the ServerApp side checks the
status and commits. The round's exchange time is from ``begin`` to the end of the last
download. Each repeat also runs a pipelined round (the ranks follow the round while they upload,
:mod:`flower_shard.dataplane.pipeline`): the same bytes, the download overlapping the upload.
The raw side: the same G x K connections each send M / K bytes to one receiving
process and get M / K bytes back, over loopback TCP. Side by side, interleaved, per G.

Memory: the VmHWM of every aggregator process, sampled; targets (fedavg, no downlink
compression): at most 3 M + 1 GB in all, growing by at most 0.05 M + 64 MiB per added group.

    .venv/bin/python bench/exchange.py [--size-gb 5 --groups 1,2,4 --ranks 2 --repeats 3]
    .venv/bin/python bench/exchange.py --smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from memory import PeakSampler  # noqa: E402

from flower_shard.dataplane import tickets  # noqa: E402
from flower_shard.dataplane.client import RankLink, UplinkEncoder  # noqa: E402
from flower_shard.dataplane.layout import Layout, rows_to_elements  # noqa: E402
from flower_shard.dataplane.pool import AggregatorPool  # noqa: E402
from flower_shard.dataplane.wire import CHUNK_VALUES, GRPC_OPTIONS  # noqa: E402

HERE = Path(__file__).parent
ROWS, COLS = 4096, 4096
FLOOR = "/bench.Floor/"  # the bare gRPC baseline's methods


class Synthetic:
    """A shard's pseudo-gradient, made per slice as a real rank makes it (``view - local``, one
    subtraction of two float32 arrays, :class:`~flower_shard.dataplane.rank.RankExchange`),
    from two seeded blocks of one chunk each, shared by a rank's pieces: nothing of the model
    is held, and no random draw is timed as if it were the exchange."""

    PAD = 4096

    def __init__(self, size: int, blocks: tuple[np.ndarray, np.ndarray]):
        self.size, (self.view, self.local) = size, blocks

    @classmethod
    def blocks(cls, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        n = CHUNK_VALUES + cls.PAD
        return tuple(rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3) for _ in "vl")

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(self.size)
        at = start % self.PAD  # chunks differ from each other
        return self.view[at : at + stop - start] - self.local[at : at + stop - start]


def layout_of(size: int, aggregators: int) -> Layout:
    n = max(1, round(size / (ROWS * COLS * 4)))
    return Layout.build({f"layer{i:04d}.weight": (ROWS, COLS) for i in range(n)}, aggregators)


def rank_ranges(layout: Layout, k: int, s: int) -> list[tuple[int, int, int]]:
    out = []
    for p in layout.params:
        c = -(-p.shape[0] // k)
        a, b = rows_to_elements(p.shape, min(s * c, p.shape[0]), c)
        b = min(b, p.numel)
        if b > a:
            out.append((p.index, a, b))
    return out


def rank_main(args) -> int:
    """One rank's round: download its shard (counted, not kept) and upload its update; one
    after the other, or pipelined (following the round on a second connection while it
    uploads, as a real rank does)."""
    layout_json, addresses, secret, rnd, group, rank, k, kind, pipelined = args
    layout = Layout.from_json(layout_json)
    token = tickets.group_token(secret, "bench", rnd, group)
    ticket = tickets.Ticket("bench", rnd, group, token, tuple(addresses), False)
    link, follow_link = RankLink(ticket, rank), RankLink(ticket, rank)
    ranges = rank_ranges(layout, k, rank)
    got = [0]

    def download() -> None:
        sink = lambda m, p, a, v: got.__setitem__(0, got[0] + v.size)  # noqa: E731
        follow_link.download(ranges, layout, -1, sink=sink, follow=pipelined)

    follower = threading.Thread(target=download)
    if pipelined:
        follower.start()
    else:
        download()
    blocks = Synthetic.blocks(group * 1000 + rank)
    pieces = [(p, a, Synthetic(b - a, blocks)) for p, a, b in ranges]
    link.upload(pieces, layout, 1000.0, UplinkEncoder(kind, 2048))
    if pipelined:
        follower.join()
    link.close()
    follow_link.close()
    return got[0]


def dataplane_round(
    pool, layout, rnd: int, groups: int, k: int, kind: str, workers, pipelined: bool = False
) -> dict:
    jobs = [
        (layout.to_json(), pool.addresses, pool.secret, rnd, g, s, k, kind, pipelined)
        for g in range(groups)
        for s in range(k)
    ]
    start = time.perf_counter()
    pool.begin(rnd)
    if pipelined:
        pool.expect(rnd, list(range(groups)))
    counts = workers.map(rank_main, jobs, chunksize=1)
    uploaded = time.perf_counter()
    status = pool.status()
    assert all(all(a.get("complete") for a in st) for st in status.values()), status
    pool.commit(rnd, {g: 1000.0 for g in range(groups)})
    end = time.perf_counter()
    numel = sum(p.numel for p in layout.params)
    assert sum(counts) == groups * numel
    return {"seconds": end - start, "commit_s": end - uploaded}


def raw_tcp(groups: int, k: int, size: int, workers) -> float:
    """G x K connections, each sending size / K bytes and receiving as many back (the receiver
    is a thread per connection of this process)."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0), backlog=groups * k)
    port = listener.getsockname()[1]
    per = size // k
    server = threading.Thread(target=_raw_server, args=(listener, groups * k, per))
    server.start()
    start = time.perf_counter()
    workers.map(_raw_client, [(port, per)] * (groups * k), chunksize=1)
    seconds = time.perf_counter() - start
    server.join()
    listener.close()
    return seconds


def _raw_server(listener: socket.socket, n: int, per: int) -> None:
    import threading

    def serve(conn):
        buf = bytearray(1 << 22)
        got = 0
        with conn:
            while got < per:
                got += conn.recv_into(buf, min(len(buf), per - got))
            sent = 0
            while sent < per:
                sent += conn.send(memoryview(buf)[: min(len(buf), per - sent)])

    threads = []
    for _ in range(n):
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=serve, args=(conn,)))
        threads[-1].start()
    for t in threads:
        t.join()


def _raw_client(args) -> None:
    port, per = args
    buf = bytearray(1 << 22)
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < per:
            sent += s.send(memoryview(buf)[: min(len(buf), per - sent)])
        got = 0
        while got < per:
            got += s.recv_into(buf, min(len(buf), per - got))


def bare_grpc(groups: int, k: int, size: int, workers) -> float:
    """The floor of any data plane in Python gRPC: the same G x K connections each stream
    size / K bytes in messages of one chunk (4 MiB) to one grpcio server of this process and
    stream as many back; no checks, no spool, no fold, no encoding."""
    from concurrent import futures

    import grpc

    def up(frames, context):
        return sum(len(f) for f in frames).to_bytes(8, "little")

    def down(request, context):
        yield from _messages(int.from_bytes(request, "little"))

    handler = grpc.method_handlers_generic_handler(
        FLOOR.strip("/"),
        {
            "Up": grpc.stream_unary_rpc_method_handler(up),
            "Down": grpc.unary_stream_rpc_method_handler(down),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(groups * k), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        start = time.perf_counter()
        moved = workers.map(_grpc_client, [(port, size // k)] * (groups * k), chunksize=1)
        seconds = time.perf_counter() - start
    finally:
        server.stop(None)
    assert moved == [2 * (size // k)] * (groups * k), moved
    return seconds


def _grpc_client(args) -> int:
    import grpc

    port, per = args
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        sent = int.from_bytes(ch.stream_unary(FLOOR + "Up")(_messages(per)), "little")
        got = sum(len(f) for f in ch.unary_stream(FLOOR + "Down")(per.to_bytes(8, "little")))
    return sent + got


def _messages(n: int):
    """``n`` bytes as messages of one chunk (4 MiB), the last one shorter."""
    chunk = bytes(4 * CHUNK_VALUES)
    for a in range(0, n, len(chunk)):
        yield chunk[: min(len(chunk), n - a)]


def measure(args, groups: int, ctx, work: Path) -> dict:
    size = int(args.size_gb * 1e9)
    layout = layout_of(size, args.aggregators)
    m = sum(p.numel for p in layout.params) * 4
    pool = AggregatorPool.start_local(
        args.aggregators, "127.0.0.1", work / f"g{groups}", None, None
    )
    settings = {
        "uplink": args.compression,
        "downlink": "none",
        "scale_chunk": 2048,
        "outer": args.outer,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
    }
    rounds, piped, raws, floors = [], [], [], []
    workers = ctx.Pool(groups * args.ranks)
    try:
        with PeakSampler(interval=0.2) as sampler:
            pool.configure("bench", layout, settings, {"kind": "random", "seed": 0, "std": 0.02})
            for r in range(1, args.repeats + 1):  # interleaved: both sides share the noise
                raws.append(raw_tcp(groups, args.ranks, m, workers))
                floors.append(bare_grpc(groups, args.ranks, m, workers))
                for pipelined, out in ((False, rounds), (True, piped)):
                    rnd, kind = 2 * r - 1 + pipelined, args.compression
                    run = (pool, layout, rnd, groups, args.ranks, kind, workers, pipelined)
                    out.append(dataplane_round(*run))
        agg = [sampler.peaks.get(p.pid, (0, ""))[0] for p in pool.processes]
        ranks = [peak for pid, (peak, cmd) in sampler.peaks.items() if "multiprocessing" in cmd]
    finally:
        workers.close()
        workers.join()
        pool.stop()
    ratios = [d["seconds"] / r for d, r in zip(rounds, raws)]
    return {
        "groups": groups,
        "model_bytes": m,
        "exchange_s": [d["seconds"] for d in rounds],
        "commit_s": [d["commit_s"] for d in rounds],
        "pipelined_s": [d["seconds"] for d in piped],
        "pipelined_commit_s": [d["commit_s"] for d in piped],
        "pipelined_ratio": _spread([d["seconds"] / r for d, r in zip(piped, raws)]),
        "raw_tcp_s": raws,
        "bare_grpc_s": floors,
        "bare_grpc_over_raw": statistics.median(f / r for f, r in zip(floors, raws)),
        "ratio": _spread(ratios),
        "aggregator_peak_bytes": agg,
        "aggregator_peak_over_m": sum(agg) / m,
        "rank_peak_bytes": max(ranks, default=0),
    }


def _spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=5.0)
    p.add_argument("--groups", default="1,2,4")
    p.add_argument("--ranks", type=int, default=2, help="K: ranks per group")
    p.add_argument("--aggregators", type=int, default=1)
    p.add_argument("--compression", default="none", choices=("none", "bf16", "int8"))
    p.add_argument("--outer", default="fedavg", choices=("fedavg", "nesterov"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "exchange.json"))
    p.add_argument("--smoke", action="store_true", help="64 MB, G = 1, 2, one repeat")
    args = p.parse_args()
    if args.smoke:
        args.size_gb, args.groups, args.repeats = 0.0672, "1,2", 1
    ctx = multiprocessing.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory(prefix="flower-shard-exchange-") as tmp:
        for g in [int(x) for x in args.groups.split(",")]:
            results.append(measure(args, g, ctx, Path(tmp)))
    m = results[0]["model_bytes"]
    print(
        f"model {m / 1e9:.2f} GB float32, K = {args.ranks}, A = {args.aggregators}, "
        f"uplink {args.compression}, outer {args.outer}, {args.repeats} repeat(s)"
    )
    print(
        "| G | exchange s (median) | raw TCP s | ratio min/median/max | pipelined s "
        "| its ratio min/median/max | bare gRPC x raw TCP | aggregator peak / M |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        a, b = r["ratio"], r["pipelined_ratio"]
        print(
            f"| {r['groups']} | {statistics.median(r['exchange_s']):.1f} | "
            f"{statistics.median(r['raw_tcp_s']):.1f} | {a['min']:.2f} / "
            f"{a['median']:.2f} / {a['max']:.2f} | {statistics.median(r['pipelined_s']):.1f} | "
            f"{b['min']:.2f} / {b['median']:.2f} / {b['max']:.2f} | "
            f"{r['bare_grpc_over_raw']:.2f} | {r['aggregator_peak_over_m']:.2f} |"
        )
    if len(results) > 1:
        first, last = results[0], results[-1]
        per_group = (sum(last["aggregator_peak_bytes"]) - sum(first["aggregator_peak_bytes"])) / (
            last["groups"] - first["groups"]
        )
        print(
            f"aggregator peak growth per added group: {per_group / 1e6:.0f} MB "
            f"({per_group / m:.3f} M)"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
