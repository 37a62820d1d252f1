"""Soak: a long flower-transport run on a real local deployment, with groups that die or lie.

50 rounds of the tiny model on G groups (default 3) plus one more node started as its own
``flower-shard node`` process. At seeded random rounds, spaced so each fault's effect is over
before the next:

- **hostile replies**: node 0's group sends, once each, every kind of bad reply of
  :data:`flower_shard.flower.group.faults.HOSTILE_REPLIES` (non-finite or 1e6x weights, a
  missing, extra or misshapen array, a model sent back unchanged, an update whose whole norm is
  on one coordinate, NaN/inf/list metrics, a token weight of 1e30 or 1.7e308). Each must be
  rejected with a reason in its round's ``rejected`` list, and the round go on with the others;
- **killed ranks**: a rank of a random other group of the deployment is SIGKILLed (at most
  ``--kills``); the node restarts its group, which rejoins from the global weights and its
  last checkpoint;
- **a killed node launcher**: the separate node's ``flower-shard node`` is SIGKILLed (no
  cleanup of its own runs): every process it started must be gone within seconds (parent-death
  signals); then it is started again on the same work directory and must take part again.

Printed: rounds completed, each fault with its round and outcome, and whether any weight was
lost: the final global model must be finite and equal to the server's last checkpoint.

    .venv/bin/python bench/soak.py                     # 50 rounds (~8 min on 2 cores)
    .venv/bin/python bench/soak.py --rounds 40 --kills 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import command, descendants  # noqa: E402

from flower_shard import protocol as P  # noqa: E402
from flower_shard import runfiles as F  # noqa: E402
from flower_shard.flower.group.faults import HOSTILE_REPLIES  # noqa: E402
from flower_shard.launch.deployment import LocalDeployment  # noqa: E402
from flower_shard.launch.processes import free_port  # noqa: E402
from flower_shard.runtime import checkpoint as C  # noqa: E402
from flower_shard.ux.metrics import read_metrics  # noqa: E402

HOSTILE, KILL, LAUNCHER = "hostile", "kill", "launcher"
# Rounds each event needs before the next one: a rank kill or a launcher kill takes its group
# out for a few rounds (restart, rendezvous, load), a hostile reply only its own round.
GAP = {HOSTILE: 2, KILL: 3, LAUNCHER: 4}
GONE_WITHIN_S = 15.0  # a SIGKILLed launcher's children get their parent-death signal at once
NODE_UP_S = 240.0


@dataclass
class Event:
    """One fault: what, when, and what came of it."""

    kind: str
    round: int
    detail: str = ""
    outcome: dict = field(default_factory=dict)


def schedule(rng: random.Random, rounds: int, kills: int) -> list[Event]:
    """Every hostile reply once, ``kills`` rank kills and one launcher kill, shuffled and
    spaced by :data:`GAP` from round 3 on."""
    kinds = [(HOSTILE, k) for k in HOSTILE_REPLIES] + [(KILL, "")] * kills + [(LAUNCHER, "")]
    rng.shuffle(kinds)
    events, at = [], 3
    for kind, detail in kinds:
        events.append(Event(kind, at, detail))
        at += GAP[kind]
    if at > rounds:
        raise SystemExit(f"soak: {len(kinds)} faults need --rounds {at} or more")
    return events


class SeparateNode:
    """A ``flower-shard node`` as a user starts it: its own process, which can be SIGKILLed."""

    def __init__(self, superlink: str, work: Path, log: Path):
        self.args = [sys.executable, "-m", "flower_shard.ux.cli", "node", "--superlink", superlink]
        self.args += ["--nproc-per-group", "1", "--work-dir", str(work)]
        self.log, self.proc = log, None

    def start(self) -> None:
        mark = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + NODE_UP_S
        while "flower-shard node: group of" not in self.log.read_text()[mark:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"soak: the separate node did not come up:\n{self.tail()}")
            time.sleep(0.2)

    def kill(self) -> list[str]:
        """SIGKILL the launcher; the commands of its processes still alive after
        :data:`GONE_WITHIN_S` (killed then, so nothing leaks)."""
        tree = {pid: command(pid) for pid in descendants(self.proc.pid) if pid != self.proc.pid}
        self.proc.kill()
        self.proc.wait(timeout=10)
        deadline = time.monotonic() + GONE_WITHIN_S
        left = list(tree)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if command(p) == tree[p]]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return [tree[p] for p in left]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""


def inject(event: Event, dep: LocalDeployment, node: SeparateNode, rng: random.Random) -> None:
    """Carry out a kill (hostile replies are in node 0's fault file already)."""
    if event.kind == KILL:
        # A rank of another deployment node with a live group and restarts left.
        nodes = [
            i
            for i, n in enumerate(dep.nodes)
            if i > 0 and n.rank_pids() and n.restarts < n.cfg.max_restarts
        ]
        if nodes:
            i = rng.choice(nodes)
            os.kill(rng.choice(dep.nodes[i].rank_pids()), signal.SIGKILL)
            event.detail = f"node {i}"
        else:
            event.detail = "skipped: no node with a live group and restarts left"
    elif event.kind == LAUNCHER:
        event.outcome["orphans"] = node.kill()
        node.start()
    print(f"soak: round {event.round}: {event.kind} {event.detail}".rstrip(), flush=True)


def judge(events: list[Event], rounds: list[dict], groups: int) -> None:
    """Fill each event's outcome from the run's metrics."""
    by_round = {r[P.ROUND]: r for r in rounds}
    for e in events:
        rec = by_round.get(e.round, {})
        if e.kind == HOSTILE:
            lines = [x for x in rec.get(P.REJECTED, []) if "no reply within" not in x]
            e.outcome["rejected"] = lines
            e.outcome["ok"] = bool(lines) and rec.get(P.GROUPS_OK, 0) >= 1
        else:  # took part again: a later round with every group in
            again = [r[P.ROUND] for r in rounds if r[P.ROUND] > e.round + 1]
            back = [r for r in again if by_round[r][P.GROUPS_OK] == groups]
            e.outcome["back_in_round"] = back[0] if back else None
            skipped = e.detail.startswith("skipped")
            e.outcome["ok"] = (skipped or bool(back)) and not e.outcome.get("orphans")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--groups", type=int, default=3, help="groups of the local deployment")
    p.add_argument("--kills", type=int, default=4, help="ranks killed over the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON with the figures (default: print only)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    events = schedule(rng, args.rounds, args.kills)
    hostile = ",".join(f"{e.round}:{e.detail}" for e in events if e.kind == HOSTILE)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fault = work / "fault"
        fault.write_text(hostile)
        faults = [str(fault)] + [None] * (args.groups - 1)
        with LocalDeployment(work, args.groups, 1, fault_files=faults) as dep:
            node = SeparateNode(dep.address, work / "separate-node", work / "separate-node.log")
            try:
                node.start()
                due = {e.round: e for e in events if e.kind != HOSTILE}

                def on_round(record: dict) -> None:
                    if record[P.ROUND] in due:
                        inject(due[record[P.ROUND]], dep, node, rng)

                out = work / "run"
                summary = dep.run(
                    {
                        P.NUM_SERVER_ROUNDS: args.rounds,
                        P.LOCAL_STEPS: 2,
                        P.OUT_DIR: str(out),
                        P.TRANSPORT: "flower",
                        P.MIN_GROUPS: 1,
                        P.ROUND_TIMEOUT: 60,
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
            finally:
                node.stop()
            restarts = [n.restarts for n in dep.nodes]
        rounds = read_metrics(out)
        judge(events, rounds, args.groups + 1)
        final = load_file(out / F.FINAL_MODEL)
        last = C.latest_good(out / "checkpoints" / "server")
        saved, _, _ = C.load_server(last[1])
    lost = not (
        all(np.isfinite(v).all() for v in final.values())
        and last[0] == args.rounds
        and all(np.array_equal(final[k], saved[k]) for k in final)
    )
    figures = {
        "status": summary[P.S_STATUS],
        "rounds_completed": len(rounds),
        "rounds_asked": args.rounds,
        "faults": [vars(e) for e in events],
        "faults_survived": sum(e.outcome["ok"] for e in events),
        "faults_injected": len(events),
        "group_restarts": restarts,
        "rejected_updates": sum(r[P.GROUPS_REJECTED] for r in rounds),
        "weights_lost": lost,
        "final_eval_ppl": rounds[-1].get(P.EVAL_PPL),
    }
    for e in events:
        what = f"{e.kind} {e.detail}".strip()
        seen = e.outcome.get("rejected") or e.outcome.get("back_in_round")
        print(f"round {e.round:3d}  {what:28s} {'ok ' if e.outcome['ok'] else 'BAD'}  {seen}")
    for k, v in figures.items():
        if k != "faults":
            print(f"{k:30s} {v}")
    ok = figures["rounds_completed"] == args.rounds and not lost
    ok = ok and figures["faults_survived"] == len(events)
    print(f"soak: {'every fault survived, nothing lost' if ok else 'FAILED'}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
