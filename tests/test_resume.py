"""Server failure and exact resume on a real Flower deployment, for both transports.

A run of 4 rounds straight through is the reference. A second run with the same settings has
its ServerApp killed (SIGKILL) after round 2; a new ``flwr run`` with ``resume`` continues it on
the same, still running groups. The resumed run must end bit-identical to the straight one.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import flat_state
from safetensors.numpy import load_file

from flower_shard import checkpoint as C
from flower_shard import protocol as P
from flower_shard.clients.group_service import RUN_FILE
from flower_shard.deployment import LocalDeployment
from flower_shard.metrics import read_metrics
from flower_shard.processes import free_port

ROUNDS = 4


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with LocalDeployment(tmp_path_factory.mktemp("resume"), num_nodes=2, nproc_per_group=2) as dep:
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
    } | extra


class ServerKilled(Exception):
    pass


def serverapp_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(part.endswith(b"flwr-serverapp") for part in cmd[:2]):
                pids.append(int(entry.name))
    return pids


def kill_serverapp_after(rnd: int):
    def on_round(record: dict) -> None:
        if record["round"] >= rnd:
            pids = serverapp_pids()
            assert pids, "no flwr-serverapp process to kill"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            raise ServerKilled

    return on_round


def group_checkpoint(dep: LocalDeployment, node: int, run_name: Path, rnd: int) -> Path:
    """Node ``node``'s checkpoint of round ``rnd`` of the run first started in ``run_name``."""
    for root in (dep.work_dir / f"node{node}" / "checkpoints").iterdir():
        if json.loads((root / RUN_FILE).read_text())[P.RUN_NAME] == str(run_name):
            return C.round_dir(root, rnd)
    raise AssertionError(f"node {node} has no checkpoints of {run_name}")


@pytest.mark.parametrize("transport", ["flower", "collective"])
def test_server_killed_then_resumed_ends_bit_identical(deployment, tmp_path, transport):
    straight, killed, resumed = tmp_path / "straight", tmp_path / "killed", tmp_path / "resumed"
    assert deployment.run(config(straight, transport))["status"] == "ok"

    with pytest.raises(ServerKilled):
        deployment.run(config(killed, transport), on_round=kill_serverapp_after(2))
    time.sleep(1)
    assert not serverapp_pids()
    saved = C.rounds(killed / "checkpoints" / "server")
    assert saved and max(saved) >= 2

    summary = deployment.run(config(resumed, transport, resume=str(killed)))
    assert summary["status"] == "ok" and summary["rounds"] == ROUNDS
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    assert [r.get("eval_loss") for r in a] == [r.get("eval_loss") for r in b]
    assert a[-1]["eval_loss"] > 0
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert a[-1]["tokens"] == b[-1]["tokens"]

    # The groups' whole state after round 4 (weights, AdamW, outer state, data position).
    for node in (0, 1):
        sa = flat_state(group_checkpoint(deployment, node, straight, 4), tmp_path / "a.pt")
        sb = flat_state(group_checkpoint(deployment, node, killed, 4), tmp_path / "b.pt")
        assert sa.keys() == sb.keys()
        for k in sa:
            same = torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k]
            assert same, f"node {node}: {k}"
    if transport == "flower":
        fa = load_file(straight / "final_model.safetensors")
        fb = load_file(resumed / "final_model.safetensors")
        assert all(np.array_equal(fa[k], fb[k]) for k in fa)
