"""Shared fixtures: a prepared corpus (once per session) and a torchrun runner that cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, MessageType, Metadata, RecordDict

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import TrainConfig
from flower_shard.data.corpus import prepare_corpus
from flower_shard.launch.torchrun import run_supervised, worker_env

DIST = Path(__file__).parent / "dist"


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """The default corpus (the standard library's source), tokenised once for the whole session."""
    out = tmp_path_factory.mktemp("corpus")
    prepare_corpus(out)
    return out


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> None:
    """Run tests/dist/SCRIPT under torchrun with NPROC ranks; fail with its output on error."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(DIST / script),
        *map(str, args),
    ]
    env = worker_env(TrainConfig(groups=1, nproc_per_group=nproc))
    env["PYTHONPATH"] = os.pathsep.join([str(DIST), env.get("PYTHONPATH", "")])
    log = Path(args[-1] if args else ".") / f"{Path(script).stem}.log"
    with open(log, "w") as fh:
        rc = run_supervised(cmd, env, timeout=timeout, stdout=fh, stderr=fh)
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{script} exited {rc} (124 = timed out):\n{tail}")


def train_cli(out: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`flower-shard train --out OUT FLAGS...` as a user runs it; fails the test on error."""
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "train", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def flat_state(directory, scratch) -> dict:
    """A group checkpoint as full tensors (model, AdamW state, outer state), read offline."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, scratch)
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(torch.load(scratch, weights_only=False), "")
    return out


def assert_tensorboard_is_metrics(run_dir) -> None:
    """``run_dir/tensorboard`` holds every numeric field of every round of ``metrics.jsonl``
    as a scalar (tag = the field, step = the round), the value as float32, and nothing else."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flower_shard.ux import metrics as M

    rounds = M.read_metrics(run_dir)
    events = EventAccumulator(str(Path(run_dir, F.TENSORBOARD_DIR)), size_guidance={"scalars": 0})
    events.Reload()

    def numeric(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    expected = {}
    for r in rounds:
        for key, value in r.items():
            if key != P.ROUND and numeric(value):
                expected.setdefault(key, []).append((r[P.ROUND], np.float32(value)))
    assert expected, "no numeric fields in metrics.jsonl"
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, values in expected.items():
        assert [(e.step, np.float32(e.value)) for e in events.Scalars(tag)] == values, tag


def instruction(node: int, message_type: str = MessageType.TRAIN) -> Message:
    """What the server sent ``node`` (the metadata the SuperLink would have set: the message
    id, which the reply's ``reply_to_message_id`` names)."""
    metadata = Metadata(
        run_id=7,
        message_id=f"ins-{node}",
        src_node_id=0,
        dst_node_id=node,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=3600.0,
        message_type=message_type,
    )
    return Message(content=RecordDict({P.CONFIG: ConfigRecord({})}), metadata=metadata)
