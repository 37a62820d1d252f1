"""Moving a model server -> group -> server per round: the flower and streaming transports
against raw loopback TCP, with every process's peak memory.

A real deployment (SuperLink + 1 node of 2 ranks) runs a few rounds of one local step per
transport; a round's exchange is its wall time minus the group's own training steps, so it
holds everything a round does to move the weights both ways (flower: Messages, object store,
ClientApp, control service, loading into and gathering from the sharded model; streaming: the
ticket, every rank's pull and push, the aggregators' checks, fold and outer step). Raw side:
the same number of bytes sent over a loopback TCP socket and echoed back. Rounds after the
first are counted; the transports and the raw side alternate, repeat after repeat.

Memory: the VmHWM of every process of the deployment, sampled, by role (SuperLink, ServerApp,
SuperNode, ClientApp, aggregators, ranks), for each model (``--models``, default ``small``
(51 MB) and ``base`` (417 MB)): what the SuperLink, SuperNode and ClientApp hold must not grow
with the model under the streaming transport.

    .venv/bin/python bench/transfer.py [--rounds 3 --repeats 3 --transports flower,streaming]
    .venv/bin/python bench/transfer.py --exchange-only [bench/exchange.py's flags]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from memory import PeakSampler  # noqa: E402

from flower_shard import protocol as P  # noqa: E402
from flower_shard.launch.deployment import LocalDeployment  # noqa: E402
from flower_shard.launch.processes import free_port  # noqa: E402
from flower_shard.ux.metrics import read_metrics  # noqa: E402

HERE = Path(__file__).parent
CHUNK = 1 << 20
ROLES = {  # a process's role, from a piece of its command line
    "flower-superlink": "superlink",
    "flwr-serverapp": "serverapp",
    "fast_supernode": "supernode",
    "warm_superexec": "clientapp",
    "flwr-clientapp": "clientapp",
    "dataplane.aggregator": "aggregator",
    "flower.group.service": "rank",
}


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


def round_trips(transport: str, model: str, rounds: int, groups: int = 1, ranks: int = 2) -> dict:
    """One deployment run of ``groups`` nodes of ``ranks`` ranks; the exchange seconds of
    rounds 2.. and every role's peak memory."""
    with (
        tempfile.TemporaryDirectory() as work,
        PeakSampler(interval=0.1) as sampler,
        LocalDeployment(work, num_nodes=groups, nproc_per_group=ranks) as dep,
    ):
        out = Path(work, "out")
        config = {
            P.OUT_DIR: str(out),
            P.NUM_SERVER_ROUNDS: rounds,
            P.LOCAL_STEPS: 1,
            P.MIN_GROUPS: groups,
            P.TRANSPORT: transport,
            "model": model,
            "seq-len": 16,
            "batch-size": 1,
            "eval-every": 0,
            P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
        }
        if transport == P.STREAMING:
            config["dataplane-insecure"] = True
        summary = dep.run(config, timeout=1800)
        if summary.get(P.S_STATUS) != P.STATUS_OK:
            raise SystemExit(f"{transport} {model}: {summary}")
        recs = read_metrics(out)
    peaks: dict[str, int] = {}
    for peak, cmd in sampler.peaks.values():
        role = next((r for key, r in ROLES.items() if key in cmd), None)
        if role:
            peaks[role] = max(peaks.get(role, 0), peak)
    return {"exchange_s": [r["round_s"] - r["compute_s"] for r in recs[1:]], "peaks": peaks}


def model_bytes(model: str) -> int:
    from flower_shard.dataplane.init import parameter_shapes

    return sum(4 * _numel(s) for s in parameter_shapes(model, 257, 16).values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def spread(v: list[float]) -> dict:
    return {"min": min(v), "median": statistics.median(v), "max": max(v)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="flower,streaming")
    p.add_argument("--models", default="small,base")
    p.add_argument("--groups", default="1", help="G values, comma-separated (one node each)")
    p.add_argument("--ranks", type=int, default=2, help="K: ranks per group")
    p.add_argument("--exchange-only", action="store_true", help="run bench/exchange.py instead")
    p.add_argument("--out", default=str(HERE / "results" / "transfer.json"))
    args, rest = p.parse_known_args()
    if args.exchange_only:
        import exchange

        sys.argv = [sys.argv[0], *rest]
        exchange.main()
        return
    report: dict = {}
    for model in args.models.split(","):
        for groups in (int(g) for g in args.groups.split(",")):
            key = model if groups == 1 else f"{model} G={groups}"
            report[key] = measure(model, groups, args)
            print_model(key, report[key])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def measure(model: str, groups: int, args: argparse.Namespace) -> dict:
    """Every transport's exchange times and peaks for one model and G, raw TCP beside them."""
    nbytes = model_bytes(model)
    sides: dict[str, list[float]] = {"raw": []}
    peaks: dict[str, dict] = {}
    for rep in range(args.repeats):
        for transport in args.transports.split(","):
            got = round_trips(transport, model, args.rounds, groups, args.ranks)
            sides.setdefault(transport, []).extend(got["exchange_s"])
            peaks[transport] = {
                k: max(v, peaks.get(transport, {}).get(k, 0)) for k, v in got["peaks"].items()
            }
            # G groups' weights cross each way: G round trips of the model side by side.
            sides["raw"] += [raw_round_trip(nbytes * groups) for _ in got["exchange_s"]]
            print(
                f"{model} G={groups} repeat {rep + 1} {transport}: "
                + " ".join(f"{x:.2f}" for x in got["exchange_s"])
                + " s",
                flush=True,
            )
    raw = statistics.median(sides["raw"])
    return {
        "model_bytes": nbytes,
        "groups": groups,
        "raw_tcp_s": spread(sides["raw"]),
        "transports": {
            t: {
                "exchange_s": spread(v),
                "ratio": spread([x / raw for x in v]),
                "peak_bytes": peaks[t],
            }
            for t, v in sides.items()
            if t != "raw"
        },
    }


def print_model(model: str, r: dict) -> None:
    print(
        f"\n{model}: {r['model_bytes'] / 1e6:.0f} MB each way; raw TCP median "
        f"{r['raw_tcp_s']['median']:.2f} s"
    )
    roles = sorted({k for t in r["transports"].values() for k in t["peak_bytes"]})
    print(
        "| transport | exchange s (median) | x raw TCP min/median/max | "
        + " | ".join(f"{k} MB" for k in roles)
        + " |"
    )
    print("|---" * (3 + len(roles)) + "|")
    for name, t in r["transports"].items():
        q = t["ratio"]
        cells = " | ".join(f"{t['peak_bytes'].get(k, 0) / 1e6:.0f}" for k in roles)
        print(
            f"| {name} | {t['exchange_s']['median']:.2f} | {q['min']:.1f} / {q['median']:.1f} / "
            f"{q['max']:.1f} | {cells} |"
        )


if __name__ == "__main__":
    main()
