"""FedAvg vs the nesterov outer optimizer (DiLoCo) under IID and non-IID partitions.

Every run is ``flower-shard train`` (the collective layout: G groups in one torchrun job) with
the same model, seed, data, T and number of rounds; only ``--partition`` and ``--outer``
change. The data is the standard library's source (byte tokens); its top-level directories and
top-level files are the sources (``test/`` alone holds about half of it):

- ``iid``: a seeded shuffle of the training blocks;
- ``by-source``: whole sources per group, balanced by blocks (with 4 groups: one group trains on
  ``test/`` alone, the other three on disjoint sets of packages and modules);
- ``dirichlet-A``: each source's blocks shared out in Dirichlet(A) proportions.

The held-out set is the same for every run. Figures: held-out perplexity after every round
(curves), final and best perplexity per setting (min / median / max over seeds), and how skewed
each partition is under the first seed (``skew``: the block-weighted mean, over sources, of the
largest share of a source's blocks that one group holds; 1 = every source in one group, 1/G =
spread evenly).

    .venv/bin/python bench/noniid.py            # the run in bench/RESULTS.md (about 10 minutes)
    .venv/bin/python bench/noniid.py --smoke    # seconds: 2 rounds, 1 seed, 2 settings
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flower_shard.data.corpus import load_blocks, load_documents, prepare_corpus
from flower_shard.data.partition import block_documents, partition_data
from flower_shard.protocol import EVAL_PPL
from flower_shard.ux.metrics import read_metrics

HERE = Path(__file__).parent


def partition_flags(name: str) -> list[str]:
    """``iid``, ``by-source`` or ``dirichlet-ALPHA`` as ``flower-shard train`` flags."""
    if name.startswith("dirichlet-"):
        alpha = name.split("-", 1)[1]
        return ["--partition", "dirichlet", "--partition-label", "directory"] + [
            "--dirichlet-alpha",
            alpha,
        ]
    return ["--partition", name]


def outer_flags(spec: str) -> list[str]:
    """``fedavg``, ``nesterov`` (DiLoCo's lr 0.7, momentum 0.9) or ``nesterov:LR:MOMENTUM``."""
    kind, *values = spec.split(":")
    flags = ["--outer", kind]
    if values:
        flags += ["--outer-lr", values[0], "--outer-momentum", values[1]]
    return flags


def run_once(out: Path, data: Path, common: list[str], partition: str, outer: str, seed: int):
    """One ``flower-shard train`` run; returns its eval perplexity per round and wall time."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").unlink(missing_ok=True)
    (out / "data").symlink_to(data)  # tokenised once: the launcher finds it current and reuses it
    cmd = [sys.executable, "-m", "flower_shard.ux.cli", "train", "--out", str(out)]
    cmd += common + partition_flags(partition) + outer_flags(outer) + ["--seed", str(seed)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"noniid: {shlex.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}"
        )
    records = read_metrics(out)
    return {
        "eval_ppl": [r[EVAL_PPL] for r in records],
        "train_loss": [r["train_loss"] for r in records],
        "wall_s": wall,
    }


def partition_stats(data: Path, name: str, groups: int, k: int, seq_len: int, seed: int) -> dict:
    """Blocks per group, the skew (see the module's docstring) and each group's largest
    sources, for one partition of the prepared corpus."""
    how, label, alpha = "iid", None, 0.5
    if name == "by-source":
        how = "by-source"
    elif name.startswith("dirichlet-"):
        how, label, alpha = "dirichlet", "directory", float(name.split("-", 1)[1])
    parts = partition_data(data, seq_len, groups, k, seed, how, label, alpha)
    n = len(load_blocks(data, "train", seq_len))
    docs = load_documents(data)
    source = docs.source_ids[block_documents(docs.starts, n, seq_len)]
    hist = np.zeros((groups, len(docs.sources)), dtype=np.int64)
    for g, ranks in enumerate(parts):
        hist[g] = np.bincount(source[np.concatenate(ranks)], minlength=len(docs.sources))
    per_source = hist.sum(axis=0)
    used = per_source > 0
    skew = float((hist.max(axis=0)[used]).sum() / per_source[used].sum())
    top = []
    for g in range(groups):
        order = np.argsort(-hist[g])[:3]
        top.append({docs.sources[i]: round(float(hist[g, i] / hist[g].sum()), 3) for i in order})
    return {"blocks": hist.sum(axis=1).tolist(), "skew": skew, "top_sources": top}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--nproc-per-group", type=int, default=1)
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--partitions", default="iid,by-source,dirichlet-0.1")
    p.add_argument(
        "--outers", default="fedavg,nesterov", help="fedavg, nesterov or nesterov:LR:MOMENTUM"
    )
    p.add_argument("--smoke", action="store_true", help="2 rounds, 1 seed, 2 settings")
    p.add_argument("--out", default=str(HERE / "results" / "noniid.json"))
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.seeds, args.partitions, args.outers = (
            2,
            "0",
            "by-source",
            "fedavg,nesterov",
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    partitions = args.partitions.split(",")
    outers = args.outers.split(",")
    common = [
        "--model", args.model,
        "--groups", str(args.groups),
        "--nproc-per-group", str(args.nproc_per_group),
        "--local-steps", str(args.local_steps),
        "--rounds", str(args.rounds),
        "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size),
        "--lr", str(args.lr),
        "--eval-every", "1",
        "--quiet",
    ]  # fmt: skip
    results = {
        "config": vars(args),
        "command": "flower-shard train " + shlex.join(common) + " --partition ... --outer ...",
        "partitions": {},
        "runs": {},
        "summary": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "corpus"
        prepare_corpus(data, partition_label="directory")
        for name in partitions:
            results["partitions"][name] = partition_stats(
                data, name, args.groups, args.nproc_per_group, args.seq_len, seeds[0]
            )
            print(f"noniid: {name}: skew {results['partitions'][name]['skew']:.3f}", flush=True)
        settings = [(part, outer) for part in partitions for outer in outers]
        for i, seed in enumerate(seeds):
            order = settings if i % 2 == 0 else settings[::-1]
            for part, outer in order:
                key = f"{part}/{outer}"
                run_dir = work / f"{part}-{outer.replace(':', '_')}-{seed}"
                run = run_once(run_dir, data, common, part, outer, seed)
                results["runs"].setdefault(key, {})[str(seed)] = run
                print(
                    f"noniid: seed {seed} {key:24s} final ppl {run['eval_ppl'][-1]:7.3f}  "
                    f"best {min(run['eval_ppl']):7.3f}  ({run['wall_s']:.0f} s)",
                    flush=True,
                )
    for key, by_seed in results["runs"].items():
        runs = list(by_seed.values())
        results["summary"][key] = {
            "final_ppl": spread([r["eval_ppl"][-1] for r in runs]),
            "best_ppl": spread([min(r["eval_ppl"]) for r in runs]),
            "seeds": len(runs),
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    plot(results, out.with_suffix(".png"))


def print_table(results: dict) -> None:
    print("| partition | outer | final eval ppl (min / median / max) | best eval ppl |")
    print("| --- | --- | --- | --- |")
    for key, s in results["summary"].items():
        part, outer = key.split("/")
        f, b = s["final_ppl"], s["best_ppl"]
        print(
            f"| {part} | {outer} | {f['min']:.3f} / {f['median']:.3f} / {f['max']:.3f} | "
            f"{b['min']:.3f} / {b['median']:.3f} / {b['max']:.3f} |"
        )


def plot(results: dict, path: Path) -> None:
    """Held-out perplexity per round: one panel per partition, median over seeds with the
    min-max band, one line per outer optimizer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("noniid: matplotlib is not installed (pip install '.[bench]'): no plot")
        return
    parts = list(results["partitions"])
    fig, axes = plt.subplots(1, len(parts), figsize=(4.2 * len(parts), 3.6), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, part in zip(axes, parts):
        for key, by_seed in results["runs"].items():
            if not key.startswith(part + "/"):
                continue
            curves = np.array([r["eval_ppl"] for r in by_seed.values()])
            rounds = np.arange(1, curves.shape[1] + 1)
            line = ax.plot(rounds, np.median(curves, axis=0), label=key.split("/")[1])[0]
            ax.fill_between(
                rounds, curves.min(axis=0), curves.max(axis=0), color=line.get_color(), alpha=0.2
            )
        skew = results["partitions"][part]["skew"]
        ax.set_title(f"{part} (skew {skew:.2f})")
        ax.set_xlabel("round")
        ax.set_yscale("log")
        ax.legend()
    axes[0].set_ylabel("held-out perplexity")
    cfg = results["config"]
    fig.suptitle(
        f"{cfg['model']}, G={cfg['groups']} x K={cfg['nproc_per_group']}, "
        f"T={cfg['local_steps']}, {len(cfg['seeds'].split(','))} seed(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"noniid: plot in {path}")


if __name__ == "__main__":
    main()
