"""Failures on a real Flower deployment: a killed ServerApp, a killed rank.

Server: a run of 3 rounds straight through is the reference. A second run with the same
settings has its ServerApp killed (SIGKILL) after round 2 (flower transport: while the groups
are training round 3 for it); a new ``flwr run`` with ``resume`` continues it on the same,
still running groups (the dead run's tasks must neither block nor take down the nodes). The
resumed run must end bit-identical to the straight one, for each transport (streaming: the
dead ServerApp's aggregators go with it, the resumed one's start from the server checkpoint).

Group: a rank of one group is killed (SIGKILL) during a round; the round completes with the
other group, the node restarts the group, which rejoins from the global weights and its own
last checkpoint, and the run finishes every round.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import flat_state
from safetensors.numpy import load_file

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import free_port, marked_pids
from flower_shard.runtime import checkpoint as C
from flower_shard.ux.metrics import read_metrics

ROUNDS = 3


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    work = tmp_path_factory.mktemp("failures")
    dump = work / "dump"
    dump.mkdir()
    with LocalDeployment(work, num_nodes=2, nproc_per_group=2, dump_dir=str(dump)) as dep:
        dep.dump = dump
        yield dep


def config(out: Path, transport: str, **extra) -> dict:
    return {
        P.NUM_SERVER_ROUNDS: ROUNDS,
        P.LOCAL_STEPS: 2,
        P.OUT_DIR: str(out),
        P.TRANSPORT: transport,
        P.OUTER_OPTIMIZER: "nesterov",
        P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
        "model": "tiny",
        "seq-len": 32,
        "batch-size": 2,
        "lr": 3e-3,
        "eval-sequences": 8,
        "checkpoint-every": 1,
        "eval-every": 2,
        # streaming: its aggregators on loopback, without TLS on purpose
        "dataplane-insecure": transport == P.STREAMING,
    } | extra


class ServerKilled(Exception):
    pass


def serverapp_pids(deployment: LocalDeployment) -> list[int]:
    """This deployment's ServerApp processes (the SuperLink's children carry its marker): never
    another suite's on the same host."""
    pids = []
    for pid in marked_pids(deployment.superlink.marker):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"flwr-serverapp") for part in cmd[:2]):
            pids.append(pid)
    return pids


def kill_serverapp_after(deployment: LocalDeployment, rnd: int, dump: Path | None = None):
    """Kill the ServerApp once round ``rnd`` is recorded and, with ``dump``, once both groups
    have trained round ``rnd + 1``: the dead run leaves tasks behind on the nodes, which must
    not harm the next."""

    def on_round(record: dict) -> None:
        if record["round"] >= rnd:
            trained = [dump / f"g{g}_r{rnd + 1}_trained.safetensors" for g in (0, 1) if dump]
            deadline = time.monotonic() + 120
            while not all(f.exists() for f in trained) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(f.exists() for f in trained), "the groups never started the next round"
            pids = serverapp_pids(deployment)
            assert pids, "no flwr-serverapp process to kill"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            raise ServerKilled

    return on_round


def group_checkpoint(dep: LocalDeployment, node: int, run_name: Path, rnd: int) -> Path:
    """Node ``node``'s checkpoint of round ``rnd`` of the run first started in ``run_name``."""
    for root in (dep.work_dir / f"node{node}" / "checkpoints").iterdir():
        if json.loads((root / F.RUN_FILE).read_text())[P.RUN_NAME] == str(run_name):
            return C.round_dir(root, rnd)
    raise AssertionError(f"node {node} has no checkpoints of {run_name}")


# Streaming runs overlapped (flower/group/overlap.py): round 1 holds the updates back, rounds 2
# (its checkpoint) and 3 drain, and the resumed run starts with nothing in flight.
OVERLAPPED = {P.OUTER_OVERLAP: True, "checkpoint-every": 2}


@pytest.mark.parametrize(
    "transport,extra",
    [("flower", {}), ("collective", {}), ("streaming", OVERLAPPED)],
    ids=["flower", "collective", "streaming-overlapped"],
)
def test_server_killed_then_resumed_ends_bit_identical(deployment, tmp_path, transport, extra):
    straight, killed, resumed = tmp_path / "straight", tmp_path / "killed", tmp_path / "resumed"
    assert deployment.run(config(straight, transport, **extra))["status"] == "ok"

    for g in (0, 1):
        (deployment.dump / f"g{g}_r3_trained.safetensors").unlink(missing_ok=True)
    with pytest.raises(ServerKilled):
        # Killed once both groups have trained round 3: collective, as they enter its sync (the
        # dead run's store goes with the ServerApp; a group still waiting in that sync gives it
        # up when the resumed run's command arrives, flower/group/abandon.py, and rolls back).
        kill = kill_serverapp_after(deployment, 2, deployment.dump)
        deployment.run(config(killed, transport, **extra), on_round=kill)
    time.sleep(1)
    assert not serverapp_pids(deployment)
    saved = C.rounds(killed / "checkpoints" / "server")
    assert saved and max(saved) >= 2

    summary = deployment.run(config(resumed, transport, resume=str(killed), **extra))
    assert summary["status"] == "ok" and summary["rounds"] == ROUNDS
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["round"] for r in b] == [1, 2, 3]
    assert [r.get("eval_loss") for r in a] == [r.get("eval_loss") for r in b]
    assert a[-1]["eval_loss"] > 0
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert a[-1]["tokens"] == b[-1]["tokens"]

    # The groups' whole state after the last round (weights, AdamW, outer state, data position).
    for node in (0, 1):
        sa = flat_state(group_checkpoint(deployment, node, straight, ROUNDS), tmp_path / "a.pt")
        sb = flat_state(group_checkpoint(deployment, node, killed, ROUNDS), tmp_path / "b.pt")
        assert sa.keys() == sb.keys()
        for k in sa:
            same = torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k]
            assert same, f"node {node}: {k}"
    if transport != "collective":
        fa = load_file(straight / "final_model.safetensors")
        fb = load_file(resumed / "final_model.safetensors")
        assert all(np.array_equal(fa[k], fb[k]) for k in fa)


def test_group_killed_mid_round_restarts_and_rejoins(deployment, tmp_path):
    node = deployment.nodes[1]
    old_marker, restarts = node.group.marker, node.restarts
    started = deployment.dump / "g1_r2_loaded.safetensors"  # the group is training round 2
    started.unlink(missing_ok=True)
    killed = []

    def kill_a_rank_mid_round() -> None:
        deadline = time.monotonic() + 300
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        victims = node.rank_pids()
        if len(victims) == 2:
            os.kill(victims[-1], signal.SIGKILL)
            killed.append(victims[-1])

    killer = threading.Thread(target=kill_a_rank_mid_round, daemon=True)
    killer.start()
    # T = 24: the round lasts ~1 s, far longer than the kill takes to land (at T = 8 the
    # group could finish round 2 before the SIGKILL arrived).
    run_config = config(tmp_path, "flower", **{P.NUM_SERVER_ROUNDS: 6, P.LOCAL_STEPS: 24})
    summary = deployment.run(run_config | {P.MIN_GROUPS: 1})
    killer.join(timeout=5)
    assert killed, "no rank was killed"
    assert summary["status"] == "ok" and summary["rounds"] == 6
    rounds = read_metrics(tmp_path)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5, 6]  # nothing stopped the run
    assert rounds[0]["groups_ok"] == 2
    # The kill lands while round 2 trains; on a loaded machine the group may just have replied,
    # and then round 3 is the one its dead rank fails (or its restart takes round 3 too).
    failed = [r for r in rounds if r["groups_rejected"]]
    assert [r["round"] for r in failed] in ([2], [3], [2, 3]), rounds
    assert failed[0]["groups_ok"] == 1 and "error reply" in failed[0]["rejected"][0]
    assert rounds[-1]["groups_ok"] == 2  # the restarted group is back
    assert node.restarts == restarts + 1
    assert not marked_pids(old_marker), "the dead group left processes behind"
    log = (node.work_dir / "group.log").read_text()
    assert "rejoined round" in log and "checkpoint of round" in log

    # The rejoined group started the last round from exactly the global model.
    global_5, _, _ = C.load_server(C.round_dir(tmp_path / "checkpoints" / "server", 5))
    for g in (0, 1):
        loaded = load_file(deployment.dump / f"g{g}_r6_loaded.safetensors")
        assert all(np.array_equal(loaded[k], global_5[k]) for k in global_5), g


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """3 groups of 1 rank; the third dies (SIGKILL, all ranks) before its sync in round 2."""
    work = tmp_path_factory.mktemp("trio")
    dump = work / "dump"
    dump.mkdir()
    fault = work / "fault"
    fault.write_text("2:die")
    with LocalDeployment(
        work,
        num_nodes=3,
        nproc_per_group=1,
        dump_dir=str(dump),
        fault_files=[None, None, str(fault)],
    ) as dep:
        dep.dump = dump
        yield dep


def test_collective_sync_survives_a_dead_group_which_then_catches_up(trio, tmp_path):
    """Round 2's sync is abandoned by the two live groups (the third died in it); the next
    rounds sync without the dead group until its node has restarted it; then the probe finds it
    up, and it rejoins through the catch-up: it starts its first round back from exactly the
    global model the others hold, and from then on all three sync. Round 2 lasts the sync
    timeout (20 s: the live groups wait for the dead one), which the restart fits in."""
    rounds_total = 5
    run_config = config(
        tmp_path,
        "collective",
        **{
            P.MIN_GROUPS: 1,
            P.SYNC_TIMEOUT: 20.0,
            P.OUTER_OPTIMIZER: "fedavg",
            P.NUM_SERVER_ROUNDS: rounds_total,
        },
    )
    summary = trio.run(run_config | {"checkpoint-every": 0})
    assert summary["status"] == "ok" and summary["rounds"] == rounds_total
    rounds = read_metrics(tmp_path)
    ok = [r["groups_ok"] for r in rounds]
    assert ok[:2] == [3, 0], ok
    abandoned = [r for r in rounds[1]["rejected"] if P.SYNC_ABANDONED in r]
    assert len(abandoned) == 2 and len(rounds[1]["rejected"]) == 3  # 2 live groups + the dead
    back = next(i for i in range(2, rounds_total) if ok[i] == 3)  # its first round back
    assert ok[2:back] == [2] * (back - 2) and ok[back:] == [3] * (rounds_total - back), ok
    dropped = [r["groups_dropped"] for r in rounds]
    assert dropped == [0] + [1] * (back - 1) + [0] * (rounds_total - back), dropped
    assert rounds[-1]["eval_loss"] > 0  # evaluated by the live groups
    assert trio.nodes[2].restarts == 1  # its node brought it back

    def dumped(g, rnd, stage):
        return load_file(trio.dump / f"g{g}_r{rnd}_{stage}.safetensors")

    assert not list(trio.dump.glob("g*_r2_synced.safetensors"))  # round 2's sync: abandoned
    # The one catch-up: the dead group's, in its first round back (its partition kept).
    caught_up = [f.name.split("_") for f in trio.dump.glob("g*_r*_caught-up.safetensors")]
    assert [int(r[1:]) for _, r, _ in caught_up] == [back + 1], caught_up
    joiner = int(caught_up[0][0][1:])
    live = [g for g in (0, 1, 2) if g != joiner]
    for rnd in range(3, back + 1):  # the cross-group group was rebuilt from the 2 live groups
        trained = [dumped(g, rnd, "trained") for g in live]
        synced = [dumped(g, rnd, "synced") for g in live]
        for k in trained[0]:
            mean = (trained[0][k] + trained[1][k]) / np.float32(2)
            assert np.array_equal(synced[0][k], mean) and np.array_equal(synced[1][k], mean), k
    # The catch-up gave the joiner exactly the model the others made in the round before.
    caught = dumped(joiner, back + 1, "caught-up")
    # (after round 2's abandoned sync the source holds its own trained weights: rolled back)
    before = dumped(live[0], back, "synced" if back > 2 else "trained")
    assert all(np.array_equal(caught[k], before[k]) for k in before)
    # From then on the three groups hold one model, bit for bit, the mean of what they trained.
    for rnd in range(back + 1, rounds_total + 1):
        synced = [dumped(g, rnd, "synced") for g in (0, 1, 2)]
        trained = [dumped(g, rnd, "trained") for g in (0, 1, 2)]
        for k in synced[0]:
            assert np.array_equal(synced[0][k], synced[1][k]), (rnd, k)
            assert np.array_equal(synced[0][k], synced[2][k]), (rnd, k)
            mean = sum(t[k].astype(np.float64) for t in trained) / 3
            np.testing.assert_allclose(synced[0][k], mean, rtol=0, atol=1e-6)
