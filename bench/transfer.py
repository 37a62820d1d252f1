"""Moving a ~100M-parameter float32 model server -> group -> server: Flower vs raw loopback TCP.

Flower side: a real deployment (SuperLink + 1 node of 2 ranks), preset ``base`` (104M
parameters, 417 MB in float32), one local step per round; the transfer time of a round is its
wall time minus the group's training steps, so it holds everything a round does to move the
weights both ways (Messages, object store, ClientApp, control service, loading into and
gathering from the sharded model). Raw side: the same number of bytes sent over a loopback
TCP socket and echoed back. Rounds after the first are counted.

    .venv/bin/python bench/transfer.py [--rounds 3 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import free_port
from flower_shard.ux.metrics import read_metrics

HERE = Path(__file__).parent
CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < n:
        got += sock.recv_into(view[got:n], min(CHUNK, n - got))


def raw_round_trip(nbytes: int) -> float:
    """Seconds to send ``nbytes`` over loopback TCP and receive them back."""
    payload = bytearray(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def echo():
        conn, _ = listener.accept()
        with conn:
            buf = bytearray(nbytes)
            _recv_exact(conn, nbytes, buf)
            conn.sendall(buf)

    t = threading.Thread(target=echo)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.perf_counter()
        s.sendall(payload)
        back = bytearray(nbytes)
        _recv_exact(s, nbytes, back)
        seconds = time.perf_counter() - start
    t.join()
    listener.close()
    return seconds


def flower_round_trips(rounds: int) -> tuple[list[float], int]:
    with (
        tempfile.TemporaryDirectory() as work,
        LocalDeployment(work, num_nodes=1, nproc_per_group=2) as dep,
    ):
        out = Path(work, "out")
        dep.run(
            {
                "out-dir": str(out),
                "num-server-rounds": rounds,
                "local-steps": 1,
                "min-groups": 1,
                "model": "base",
                "seq-len": 16,
                "batch-size": 1,
                "eval-every": 0,
                "collective-address": f"127.0.0.1:{free_port()}",
            },
            timeout=1800,
        )
        recs = read_metrics(out)
    # Each round sends the model to the group and back: exchange_bytes counts both ways.
    return [r["round_s"] - r["compute_s"] for r in recs[1:]], recs[-1]["exchange_bytes"] // 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "transfer.json"))
    args = p.parse_args()
    flower, raw = [], []
    nbytes = 0
    for rep in range(args.repeats):
        got, nbytes = flower_round_trips(args.rounds)
        flower += got
        raw += [raw_round_trip(nbytes) for _ in got]
        print(
            f"repeat {rep + 1}: model {nbytes / 1e6:.0f} MB; flower "
            + " ".join(f"{x:.2f}" for x in got)
            + " s; raw TCP "
            + " ".join(f"{x:.2f}" for x in raw[-len(got) :])
            + " s",
            flush=True,
        )
    ratios = [f / r for f, r in zip(flower, raw)]

    def summary(v):
        return {"min": min(v), "median": statistics.median(v), "max": max(v)}

    report = {
        "model_bytes": nbytes,
        "flower_s": summary(flower),
        "raw_tcp_s": summary(raw),
        "ratio": summary(ratios),
        "target_ratio": 2.0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    f, r, q = report["flower_s"], report["raw_tcp_s"], report["ratio"]
    print(f"server -> group -> server, {nbytes / 1e6:.0f} MB each way")
    print(f"flower : min {f['min']:.2f} median {f['median']:.2f} max {f['max']:.2f} s")
    print(f"raw TCP: min {r['min']:.2f} median {r['median']:.2f} max {r['max']:.2f} s")
    print(f"ratio  : min {q['min']:.1f} median {q['median']:.1f} max {q['max']:.1f} (target <= 2)")


if __name__ == "__main__":
    main()
