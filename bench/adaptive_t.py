"""Adaptive T vs fixed T while the inter-site link changes speed in the middle of the run.

The two emulated sites of bench/multitier.py, FL+FSDP with the collective transport (one group
per site). Every run starts with the link at the first rate of ``--rates``. When the run has
trained half its step budget, the harness re-shapes the tbf qdisc to the second rate, and the
run continues on the new rate. Compared side by side, same model, data, seed and step budget:

- ``fixed T=a`` for each T of ``--fixed`` (a small T suits the fast link, a large one the slow);
- ``adaptive``: ``--adaptive-t`` starting at the smallest fixed T, keeping the exchange under
  ``--exchange-share`` of each round (flower_shard/planning/adaptive.py).

Figures per configuration (min / median / max over repeats, in alternating order): tokens/s
over the whole run and in each phase (before and after the switch), the exchange share of
time in each phase, the T of each round, and eval perplexity at the end (equal tokens).

    sudo .venv/bin/python bench/adaptive_t.py            # the run in bench/RESULTS.md
    sudo .venv/bin/python bench/adaptive_t.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from multitier import med as spread  # noqa: E402  (the sibling benchmark's harness)
from multitier import run_config  # noqa: E402

from flower_shard.config import TrainConfig  # noqa: E402
from flower_shard.data.corpus import prepare_corpus  # noqa: E402
from flower_shard.launch.emulated_network import EmulatedNetwork, available  # noqa: E402
from flower_shard.ux.metrics import read_metrics  # noqa: E402

HERE = Path(__file__).parent


class Reshaper:
    """``watch`` for a run: once the run's metrics show ``at_step`` steps done, re-shape every
    site's uplink to ``rate`` (once), and remember the round after which that happened."""

    def __init__(self, net: EmulatedNetwork, at_step: int, rate: float):
        self.net, self.at_step, self.rate = net, at_step, rate
        self.after_round: int | None = None

    def __call__(self, out: Path) -> None:
        if self.after_round is not None or not (out / "metrics.jsonl").exists():
            return
        try:
            records = read_metrics(out)
        except (ValueError, json.JSONDecodeError):  # a line being written
            return
        if records and records[-1]["step"] >= self.at_step:
            self.net.set_rate(self.rate)
            self.after_round = records[-1]["round"]


def phase(records: list[dict]) -> dict:
    """tokens/s and exchange share of a list of rounds."""
    if not records:
        return {"tokens_per_s": None, "exchange_share": None}
    time_s = sum(r["round_s"] for r in records)
    tokens = sum(r["round_s"] * r["tokens_per_s"] for r in records)
    return {
        "tokens_per_s": tokens / time_s,
        "exchange_share": sum(r["outer_sync_s"] for r in records) / time_s,
    }


def summarise(run: dict, after_round: int | None) -> dict:
    recs = run["metrics"]
    split = after_round if after_round is not None else len(recs)
    # The first round pays start-up; the switch round straddles both rates: both left out.
    before = recs[1:split]
    after = recs[split + 1 :]
    return {
        "tokens_per_s": phase(recs[1:])["tokens_per_s"],
        "before": phase(before),
        "after": phase(after),
        "local_steps": [r["local_steps"] for r in recs],
        "switched_after_round": after_round,
        "final_ppl": recs[-1].get("eval_ppl"),
        "rounds": len(recs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--rates", default="1000,100", help="Mbit/s before,after the switch")
    p.add_argument("--fixed", default="2,16", help="the fixed T values to compare")
    p.add_argument("--exchange-share", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=32, help="the step budget of every run")
    p.add_argument("--ranks-per-site", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 repeat, seconds")
    p.add_argument("--out", default=str(HERE / "results" / "adaptive_t.json"))
    args = p.parse_args()
    if args.smoke:
        args.model, args.steps, args.repeats, args.seq_len, args.fixed = "tiny", 8, 1, 32, "2"
    if not available():
        raise SystemExit("adaptive_t: needs root and `ip netns` (network namespaces) on Linux")
    first, second = (float(r) for r in args.rates.split(","))
    fixed = [int(t) for t in args.fixed.split(",")]
    k = args.ranks_per_site
    base = TrainConfig(
        model=args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        eval_sequences=16,
        seed=0,
        lr=1e-3,
        groups=2,
        nproc_per_group=k,
        eval_every=args.steps,  # only at the end (the last round always evaluates)
        exchange_share=args.exchange_share,
        max_local_steps=args.steps,
    )
    configs = [
        (f"fixed T={t}", dataclasses.replace(base, local_steps=t, rounds=args.steps // t))
        for t in fixed
    ]
    t0 = min(fixed)
    configs.append(
        (
            "adaptive",
            dataclasses.replace(base, local_steps=t0, rounds=args.steps // t0, adaptive_t=True),
        )
    )
    samples: dict[str, list[dict]] = {}
    # A SIGTERM unwinds the with-block below like Ctrl-C: the sites' processes and namespaces go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp, EmulatedNetwork(2, first) as net:
        work = Path(tmp)
        data = work / "corpus"
        prepare_corpus(data)
        for rep in range(args.repeats):
            for name, cfg in configs if rep % 2 == 0 else configs[::-1]:
                net.set_rate(first)
                watch = Reshaper(net, args.steps // 2, second)
                run = run_config(net, cfg, data, work, watch)
                s = summarise(run, watch.after_round)
                samples.setdefault(name, []).append(s)
                print(
                    f"repeat {rep + 1} {name:12s} {s['tokens_per_s']:7.0f} tok/s  "
                    f"before {s['before']['tokens_per_s'] or 0:7.0f}  after "
                    f"{s['after']['tokens_per_s'] or 0:7.0f}  T {s['local_steps']}  "
                    f"ppl {s['final_ppl']:.3f}",
                    flush=True,
                )
    results = {"config": vars(args), "configs": {}}
    for name, runs in samples.items():
        results["configs"][name] = {
            "tokens_per_s": spread([r["tokens_per_s"] for r in runs]),
            "before_tokens_per_s": spread([r["before"]["tokens_per_s"] for r in runs]),
            "after_tokens_per_s": spread([r["after"]["tokens_per_s"] for r in runs]),
            "before_exchange_share": spread([r["before"]["exchange_share"] for r in runs]),
            "after_exchange_share": spread([r["after"]["exchange_share"] for r in runs]),
            "final_ppl": spread([r["final_ppl"] for r in runs]),
            "runs": runs,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"link {first:g} Mbit/s, then {second:g} Mbit/s after {args.steps // 2} steps")
    for name, e in results["configs"].items():
        print(
            f"{name:12s} tokens/s {e['tokens_per_s']['median']:7.0f}  before "
            f"{e['before_tokens_per_s']['median'] or 0:7.0f} "
            f"({100 * (e['before_exchange_share']['median'] or 0):4.1f}% exchange)  after "
            f"{e['after_tokens_per_s']['median'] or 0:7.0f} "
            f"({100 * (e['after_exchange_share']['median'] or 0):4.1f}% exchange)  "
            f"ppl {e['final_ppl']['median']:.3f}  T {e['runs'][0]['local_steps']}"
        )


if __name__ == "__main__":
    main()
