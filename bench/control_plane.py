"""Control-plane overhead per Flower round on loopback: stock Flower vs flower-shard's nodes.

Three sides: stock Flower (3 s idle poll, a fresh ClientApp process per message, object pulls
retried after 1 s); the short poll alone; everything flower-shard's nodes do by default (short
poll, warm ClientApp process, pulls retried after 50 ms;
flower_shard/flower/node/fast_supernode.py).
Side by side, same deployment shape (SuperLink + 2 nodes of 2 ranks), tiny model, T=2: the
overhead of a round is its wall time minus the slowest group's own time for the round (load,
T steps, gather) and minus server-side evaluation. Rounds after the first (which builds the
groups' models) are counted.

    .venv/bin/python bench/control_plane.py [--rounds 6 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from flower_shard.flower.node.fast_supernode import PULL_ENV
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import free_port
from flower_shard.ux.metrics import read_metrics

HERE = Path(__file__).parent
SIDES = {  # name: (SuperNode idle poll, warm ClientApp, first retry of a missing object)
    "stock Flower (3 s poll, process/msg, 1 s retry)": (3.0, False, 1.0),
    "0.1 s poll, process per message, 1 s retry": (0.1, False, 1.0),
    "flower-shard (0.1 s poll, warm, 50 ms retry)": (0.1, True, 0.05),
}


def one_run(side: tuple[float, bool, float], rounds: int) -> list[float]:
    poll, warm, retry = side
    os.environ[PULL_ENV] = str(retry)  # the SuperLink, the ServerApp and the nodes inherit it
    with (
        tempfile.TemporaryDirectory() as work,
        LocalDeployment(
            work, num_nodes=2, nproc_per_group=2, poll_interval=poll, warm_clientapp=warm
        ) as dep,
    ):
        out = Path(work, "out")
        dep.run(
            {
                "out-dir": str(out),
                "num-server-rounds": rounds,
                "local-steps": 2,
                "min-groups": 2,
                "seq-len": 64,
                "batch-size": 2,
                "eval-sequences": 8,
                "collective-address": f"127.0.0.1:{free_port()}",
            },
            timeout=900,
        )
        return [r["control_overhead_s"] for r in read_metrics(out)[1:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results" / "control_plane.json"))
    args = p.parse_args()
    samples = {name: [] for name in SIDES}
    for rep in range(args.repeats):
        order = list(SIDES) if rep % 2 == 0 else list(reversed(SIDES))
        for name in order:
            got = one_run(SIDES[name], args.rounds)
            samples[name] += got
            print(f"repeat {rep + 1} {name}: " + " ".join(f"{x:.2f}" for x in got), flush=True)
    report = {
        name: {"min": min(v), "median": statistics.median(v), "max": max(v), "samples": v}
        for name, v in samples.items()
    }
    stock, ours = (report[n]["median"] for n in (list(SIDES)[0], list(SIDES)[-1]))
    report["median_ratio_stock_over_ours"] = stock / ours
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name in SIDES:
        r = report[name]
        print(
            f"{name:46s} overhead per round: min {r['min']:.2f} s, median {r['median']:.2f} s, "
            f"max {r['max']:.2f} s"
        )
    print(f"stock / ours (median): {stock / ours:.2f}x")


if __name__ == "__main__":
    main()
