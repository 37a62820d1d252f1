"""One slow group: fixed-T rounds vs time-budgeted rounds (`round-seconds`), through Flower.

A real local deployment (SuperLink + 2 nodes, flower transport). Node 1's group is the slow
one: its ranks run in a cgroup with a CPU quota (``--slow-cpu``, a share of one core), and it
may have fewer ranks than node 0's (``--nproc``). The SuperNodes and ClientApps are not
throttled: the group's compute is slow, not its Flower client.

- ``fixed``: every group trains ``--local-steps`` steps per round; the fast group waits for the
  slow one at every round (the straggler sets the pace);
- ``budget``: every group trains for ``--round-seconds`` per round (by default the slow
  group's time for ``--local-steps`` steps, measured in the first fixed run): rounds as long
  as the fixed run's and as many, but the fast group trains through the round instead of
  waiting, and the aggregation weights each group by its tokens.

Same model, data, seed, per-rank batch and number of rounds. Figures per configuration (min /
median / max over repeats, in alternating order): tokens/s over both groups, each group's
steps per round, eval perplexity (server side, every round) at the fixed run's wall-clock
budget and at the end. Time is the training time without the server-side evaluation (as in
bench/multitier.py's Flower runs).

    sudo .venv/bin/python bench/heterogeneous.py        # the run in bench/RESULTS.md
    sudo .venv/bin/python bench/heterogeneous.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from multitier import med as spread  # noqa: E402  (min / median / max, as the sibling bench)

from flower_shard import protocol as P  # noqa: E402
from flower_shard.launch.deployment import LocalDeployment  # noqa: E402
from flower_shard.launch.processes import free_port  # noqa: E402
from flower_shard.ux.metrics import read_metrics  # noqa: E402

HERE = Path(__file__).parent


class CpuQuota:
    """A cgroup (v1 ``cpu`` controller, or v2 with ``cpu`` enabled) capping its processes at
    ``cpus`` cores; created on entry, removed on exit (its processes must be gone by then)."""

    def __init__(self, name: str, cpus: float):
        self.cpus = cpus
        v1 = Path("/sys/fs/cgroup/cpu")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.path, self.v2 = v1 / name, False
        elif "cpu" in (v2 / "cgroup.controllers").read_text(errors="ignore").split():
            self.path, self.v2 = v2 / name, True
        else:
            raise SystemExit("heterogeneous: no cgroup cpu controller here (needs root, Linux)")

    def __enter__(self) -> CpuQuota:
        self.path.mkdir(exist_ok=True)
        period = 100_000
        quota = max(1000, int(self.cpus * period))
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota} {period}\n")
        else:
            (self.path / "cpu.cfs_period_us").write_text(f"{period}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        return self

    def add_tree(self, pid: int) -> list[int]:
        """Move ``pid`` and all its descendants into the cgroup; returns the pids moved."""
        moved, todo = [], [pid]
        while todo:
            p = todo.pop()
            try:
                (self.path / "cgroup.procs").write_text(f"{p}\n")
            except (ProcessLookupError, OSError):
                continue
            moved.append(p)
            for task in Path(f"/proc/{p}/task").glob("*"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return moved

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # the processes may take a moment to be reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run_once(dep: LocalDeployment, out: Path, common: dict, extra: dict) -> dict:
    """One Flower run; its rounds with the time axis and per-group figures."""
    summary = dep.run(common | extra | {P.OUT_DIR: str(out)}, timeout=3600)
    if summary[P.S_STATUS] != P.STATUS_OK:
        raise RuntimeError(f"flower run failed: {summary.get('error')}")
    rounds, elapsed = [], 0.0
    for r in read_metrics(out):
        elapsed += r["group_round_s"] + r["control_overhead_s"]  # without the server's eval
        rounds.append(r | {"train_s": elapsed})
    return {
        "rounds": rounds,
        "tokens_per_s": rounds[-1]["tokens"] / elapsed,
        "train_s": elapsed,
        "final_ppl": rounds[-1].get("eval_ppl"),
        "steps_per_round": {
            str(g["group"]): statistics.median(
                x["steps"] for r in rounds for x in r["groups"] if x["group"] == g["group"]
            )
            for g in rounds[0]["groups"]
        },
    }


def ppl_at(rounds: list[dict], seconds: float = float("inf"), tokens: float = float("inf")):
    """The last eval perplexity within ``seconds`` of training time and ``tokens`` tokens."""
    done = [
        r["eval_ppl"]
        for r in rounds
        if r["train_s"] <= seconds and r["tokens"] <= tokens and "eval_ppl" in r
    ]
    return done[-1] if done else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--nproc", default="1,1", help="ranks of the fast and of the slow group")
    p.add_argument("--slow-cpu", type=float, default=0.3, help="the slow group's cores")
    p.add_argument("--local-steps", type=int, default=32, help="T of the fixed run")
    p.add_argument("--rounds", type=int, default=6, help="rounds of the fixed run")
    p.add_argument("--round-seconds", type=float, default=0.0, help="0: measure (see above)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="2 rounds, 1 repeat, a few steps")
    p.add_argument("--out", default=str(HERE / "results" / "heterogeneous.json"))
    args = p.parse_args()
    if args.smoke:
        args.local_steps, args.rounds, args.repeats, args.seq_len = 4, 2, 1, 32
    nproc = [int(n) for n in args.nproc.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("heterogeneous: needs root (a cgroup throttles the slow group)")
    common = {
        P.LOCAL_STEPS: args.local_steps,
        P.TRANSPORT: "flower",
        P.MIN_GROUPS: 2,
        P.EVAL_EVERY: 1,
        P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
        "model": args.model,
        "seq-len": args.seq_len,
        "batch-size": args.batch_size,
        "lr": 3e-3,
        "seed": 0,
        "eval-sequences": 16,
        "max-local-steps": 64 * args.local_steps,
    }
    samples: dict[str, list[dict]] = {"fixed": [], "budget": []}
    budget_s = args.round_seconds
    # A SIGTERM unwinds the with-blocks below like Ctrl-C: processes and the cgroup go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name_ = f"flower-shard-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp, CpuQuota(name_, args.slow_cpu) as quota:
        work = Path(tmp)
        with LocalDeployment(work / "dep", num_nodes=2, nproc_per_group=nproc) as dep:
            quota.add_tree(dep.nodes[1].group.proc.pid)
            for rep in range(args.repeats):
                order = (
                    ["fixed", "budget"] if rep % 2 == 0 or budget_s <= 0 else ["budget", "fixed"]
                )
                for name in order:
                    out = work / f"{name}{rep}"
                    extra = {P.NUM_SERVER_ROUNDS: args.rounds}
                    if name == "budget":
                        if budget_s <= 0:  # the straggler's time for T steps in the fixed run
                            first = samples["fixed"][0]["rounds"]
                            budget_s = max(
                                statistics.median(
                                    x["compute_s"]
                                    for r in first[1:] or first
                                    for x in r["groups"]
                                    if x["group"] == g
                                )
                                for g in {x["group"] for x in first[0]["groups"]}
                            )
                        extra[P.ROUND_SECONDS] = budget_s
                    run = run_once(dep, out, common, extra)
                    samples[name].append(run)
                    print(
                        f"repeat {rep + 1} {name:6s} {run['tokens_per_s']:8.0f} tok/s  "
                        f"steps/round {run['steps_per_round']}  {len(run['rounds'])} rounds in "
                        f"{run['train_s']:.1f} s  final ppl {run['final_ppl']:.2f}",
                        flush=True,
                    )
    results = {"config": vars(args), "round_seconds": budget_s}
    fixed_tokens = min(r["rounds"][-1]["tokens"] for r in samples["fixed"])
    for name, runs in samples.items():
        wall = [min(r["train_s"] for r in samples["fixed"]) for _ in runs]
        results[name] = {
            "tokens_per_s": spread([r["tokens_per_s"] for r in runs]),
            "train_s": spread([r["train_s"] for r in runs]),
            "final_ppl": spread([r["final_ppl"] for r in runs]),
            "ppl_at_fixed_wall_clock": spread([ppl_at(r["rounds"], w) for r, w in zip(runs, wall)]),
            # Sample efficiency: the fast group's tokens weigh more in the mean.
            "ppl_at_fixed_tokens": spread([ppl_at(r["rounds"], tokens=fixed_tokens) for r in runs]),
            "steps_per_round": runs[0]["steps_per_round"],
            "runs": runs,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    f = results
    speed = f["budget"]["tokens_per_s"]["median"] / f["fixed"]["tokens_per_s"]["median"]
    print(f"round-seconds {budget_s:.2f}")
    for name in ("fixed", "budget"):
        e = f[name]
        print(
            f"{name:6s} tokens/s {e['tokens_per_s']['median']:.0f} "
            f"({e['tokens_per_s']['min']:.0f}-{e['tokens_per_s']['max']:.0f})  steps/round "
            f"{e['steps_per_round']}  ppl at fixed wall clock "
            f"{e['ppl_at_fixed_wall_clock']['median']}  at fixed tokens "
            f"{e['ppl_at_fixed_tokens']['median']}  final {e['final_ppl']['median']}"
        )
    print(f"budget / fixed tokens/s: {speed:.2f}x")


if __name__ == "__main__":
    main()
