"""Soak: a long flower-transport run on a real local deployment while groups are killed.

50 rounds of the tiny model, 3 groups; at seeded random rounds a rank of a random group is
SIGKILLed (a bounded number of times, at most ``--max-restarts`` per node), and one group sends
a non-finite update once. The nodes restart their groups, which rejoin from the global weights
and their last checkpoint. Printed: rounds completed, faults injected, faults survived (the
killed group took part again later), rejected updates, and whether any weight was lost: the
final global model must be finite and equal to the server's last checkpoint.

    .venv/bin/python bench/soak.py                 # 50 rounds, 4 kills (~6 min on 2 cores)
    .venv/bin/python bench/soak.py --rounds 12 --kills 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from flower_shard import protocol as P
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import free_port
from flower_shard.runtime import checkpoint as C
from flower_shard.ux.metrics import read_metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--kills", type=int, default=4, help="ranks killed over the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON with the figures (default: print only)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    kill_rounds = sorted(rng.sample(range(2, args.rounds - 4), args.kills))
    poison_round = rng.choice([r for r in range(2, args.rounds - 1) if r not in kill_rounds])
    injected: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fault = work / "fault"
        fault.write_text(f"{poison_round}:nan")
        faults = [str(fault)] + [None] * (args.groups - 1)
        with LocalDeployment(work, args.groups, 1, fault_files=faults) as dep:

            def on_round(record: dict) -> None:
                if record[P.ROUND] in kill_rounds:
                    # Only nodes with a live group and restarts left.
                    nodes = [
                        i
                        for i, n in enumerate(dep.nodes)
                        if n.rank_pids() and n.restarts < n.cfg.max_restarts
                    ]
                    if nodes:
                        i = rng.choice(nodes)
                        os.kill(rng.choice(dep.nodes[i].rank_pids()), signal.SIGKILL)
                        injected.append({"round": record[P.ROUND], "node": i})
                        print(f"soak: killed a rank of node {i} after round {record[P.ROUND]}")

            out = work / "run"
            summary = dep.run(
                {
                    P.NUM_SERVER_ROUNDS: args.rounds,
                    P.LOCAL_STEPS: 2,
                    P.OUT_DIR: str(out),
                    P.TRANSPORT: "flower",
                    P.MIN_GROUPS: 1,
                    P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
                    "model": "tiny",
                    "seq-len": 32,
                    "batch-size": 2,
                    "eval-every": 10,
                    "eval-sequences": 8,
                    "checkpoint-every": 1,
                },
                timeout=3600,
                on_round=on_round,
            )
            restarts = [n.restarts for n in dep.nodes]
        rounds = read_metrics(out)
        survived = sum(
            any(r["round"] > f["round"] + 1 and r["groups_ok"] == args.groups for r in rounds)
            for f in injected
        )
        final = load_file(out / "final_model.safetensors")
        last = C.latest_good(out / "checkpoints" / "server")
        saved, _, _ = C.load_server(last[1])
        figures = {
            "status": summary[P.S_STATUS],
            "rounds_completed": len(rounds),
            "rounds_asked": args.rounds,
            "faults_injected": len(injected) + 1,
            "kills": injected,
            "kills_survived": survived,
            "group_restarts": restarts,
            "poisoned_round": poison_round,
            "poison_rejected": any(
                "non-finite" in x
                for r in rounds
                if r["round"] == poison_round
                for x in r["rejected"]
            ),
            "rejected_updates": sum(r["groups_rejected"] for r in rounds),
            "final_model_finite": all(np.isfinite(v).all() for v in final.values()),
            "final_equals_last_checkpoint": last[0] == args.rounds
            and all(np.array_equal(final[k], saved[k]) for k in final),
            "final_eval_ppl": rounds[-1].get("eval_ppl"),
        }
    for k, v in figures.items():
        print(f"{k:30s} {v}")
    lost = not (figures["final_model_finite"] and figures["final_equals_last_checkpoint"])
    ok = (
        figures["rounds_completed"] == args.rounds
        and survived == len(injected)
        and figures["poison_rejected"]
        and not lost
    )
    print(f"soak: {'every fault survived, nothing lost' if ok else 'FAILED'}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
