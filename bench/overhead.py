"""Overhead of the group runtime over a bare FSDP2 loop: step throughput and peak RSS per rank.

Side by side in one run, same model, ranks, batches and seed; the measured window holds only
inner steps (no outer sync). Repeats alternate the order of the two sides.

    .venv/bin/python bench/overhead.py [--model small --groups 2 --nproc-per-group 2 --repeats 3]

Targets: runtime / bare throughput >= 0.95; runtime peak RSS <= 1.15 x bare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from flower_shard.config import TrainConfig
from flower_shard.data.corpus import prepare_corpus
from flower_shard.launch.torchrun import run_supervised, worker_env

HERE = Path(__file__).parent


def run_side(mode, cfg, cfg_path, data_dir, args, tmp) -> dict:
    result = Path(tmp, f"{mode}.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.world_size}",
        str(HERE / "overhead_worker.py"),
        mode,
        str(cfg_path),
        str(data_dir),
        str(args.warmup),
        str(args.steps),
        str(result),
    ]
    rc = run_supervised(cmd, worker_env(cfg), timeout=1800)
    if rc != 0:
        raise SystemExit(f"overhead: the {mode} side exited {rc}")
    return json.loads(result.read_text())


def summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--nproc-per-group", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "overhead.json"))
    args = p.parse_args()
    cfg = TrainConfig(
        groups=args.groups,
        nproc_per_group=args.nproc_per_group,
        model=args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        rounds=1000,
        local_steps=1,
        eval_every=0,
    ).validate()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp, "data")
        prepare_corpus(data_dir)
        cfg_path = Path(tmp, "config.json")
        cfg.to_json(cfg_path)
        runs = {"runtime": [], "bare": []}
        for rep in range(args.repeats):
            order = ("runtime", "bare") if rep % 2 == 0 else ("bare", "runtime")
            for mode in order:
                r = run_side(mode, cfg, cfg_path, data_dir, args, tmp)
                runs[mode].append(r)
                print(
                    f"repeat {rep + 1}/{args.repeats} {mode:7s} {r['tokens_per_s']:8.0f} tok/s"
                    f"  peak RSS {r['peak_rss_mib_max_rank']:.0f} MiB",
                    flush=True,
                )
    speed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["runtime"], runs["bare"])]
    rss = [
        a["peak_rss_mib_max_rank"] / b["peak_rss_mib_max_rank"]
        for a, b in zip(runs["runtime"], runs["bare"])
    ]
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "throughput_ratio": summary(speed),
        "peak_rss_ratio": summary(rss),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    t, m = report["throughput_ratio"], report["peak_rss_ratio"]
    print(
        f"throughput runtime/bare: min {t['min']:.3f} median {t['median']:.3f} "
        f"max {t['max']:.3f} (target >= 0.95)"
    )
    print(
        f"peak RSS  runtime/bare: min {m['min']:.3f} median {m['median']:.3f} "
        f"max {m['max']:.3f} (target <= 1.15)"
    )


if __name__ == "__main__":
    main()
