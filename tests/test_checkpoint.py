"""Checkpoints: atomic, verified directories; exact resume; loading onto another number of ranks."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import flat_state, torchrun, train_cli

from flower_shard import protocol as P
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.preflight import check
from flower_shard.runtime import checkpoint as C
from flower_shard.ux import metrics as M

# -- the directory format -------------------------------------------------------------------------


def _write(root, rnd, payload: bytes):
    tmp = C.staging_dir(root, rnd)
    (tmp / "data.bin").write_bytes(payload)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "more.bin").write_bytes(payload[::-1])
    return C.commit(tmp, root, rnd)


def test_commit_verify_and_fallback_to_the_previous_good_checkpoint(tmp_path):
    for rnd in (1, 2, 3, 4):
        _write(tmp_path, rnd, bytes([rnd]) * 1000)
    assert C.rounds(tmp_path) == [4, 3, 2, 1]
    assert all(C.verify(C.round_dir(tmp_path, r)) is None for r in (1, 2, 3, 4))
    # 4: truncated, 3: one byte flipped, 2: no manifest (as if the writer died before commit).
    (C.round_dir(tmp_path, 4) / "data.bin").write_bytes(b"\x04" * 10)
    blob = bytearray((C.round_dir(tmp_path, 3) / "sub" / "more.bin").read_bytes())
    blob[500] ^= 1
    (C.round_dir(tmp_path, 3) / "sub" / "more.bin").write_bytes(bytes(blob))
    (C.round_dir(tmp_path, 2) / C.MANIFEST).unlink()
    refused = []
    assert C.latest_good(tmp_path, log=refused.append) == (1, C.round_dir(tmp_path, 1))
    assert len(refused) == 3
    assert "10 bytes" in refused[0] and "checksum" in refused[1] and "incomplete" in refused[2]
    with pytest.raises(C.CheckpointError, match="checksum"):
        C.load_server(C.round_dir(tmp_path, 3))


def test_an_unfinished_write_is_invisible_and_keep_prunes(tmp_path):
    _write(tmp_path, 1, b"a" * 10)
    (C.staging_dir(tmp_path, 2) / "data.bin").write_bytes(b"half")  # never committed
    assert C.rounds(tmp_path) == [1]
    for rnd in (2, 3, 4):
        C.commit(C.staging_dir(tmp_path, rnd), tmp_path, rnd, keep=2)
    assert C.rounds(tmp_path) == [4, 3]
    _write(tmp_path, 4, b"new")  # rewriting a round replaces it whole
    assert (C.round_dir(tmp_path, 4) / "data.bin").read_bytes() == b"new"
    assert C.verify(C.round_dir(tmp_path, 4)) is None


def test_server_checkpoint_round_trip(tmp_path):
    import numpy as np

    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    outer = {"weights": torch.arange(6.0), "sgd": {"state": {}, "param_groups": []}}
    C.save_server(tmp_path, 5, arrays, outer, {"history": [{"round": 5}]})
    got_arrays, got_outer, state = C.load_server(C.round_dir(tmp_path, 5))
    assert np.array_equal(got_arrays["w"], arrays["w"])
    assert torch.equal(got_outer["weights"], outer["weights"])
    assert state["round"] == 5 and state["history"] == [{"round": 5}] and "rng" in state


def test_resume_needs_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="checkpoints"):
        check(TrainConfig(resume=str(tmp_path)))
    with pytest.raises(ConfigError, match="checkpoint-every"):
        TrainConfig(checkpoint_every=-1).validate()


# -- the group runtime ----------------------------------------------------------------------------

RUN = (
    "--groups", "2", "--nproc-per-group", "2", "--local-steps", "2", "--rounds", "4",
    "--seq-len", "32", "--batch-size", "2", "--outer", "nesterov", "--eval-every", "0",
    "--checkpoint-every", "1", "--quiet",
)  # fmt: skip


def assert_same_state(a, b, tmp_path):
    sa, sb = flat_state(a, tmp_path / "a.pt"), flat_state(b, tmp_path / "b.pt")
    assert sa.keys() == sb.keys()
    assert any(k.startswith("outer.momentum.") for k in sa)  # the outer state is in there
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
        else:
            assert sa[k] == sb[k], k


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """4 rounds straight through, a checkpoint every round (the last 3 kept)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    train_cli(out, *RUN)
    return out


def test_resume_is_bit_exact_and_skips_a_corrupt_checkpoint(straight_run, tmp_path):
    crashed = tmp_path / "crashed"
    shutil.copytree(straight_run, crashed)
    for g in (0, 1):  # the run "died" during round 4, and round 3's checkpoint got damaged
        root = crashed / "checkpoints" / f"group_{g}"
        shutil.rmtree(C.round_dir(root, 4))
    shard = next(C.round_dir(crashed / "checkpoints" / "group_1", 3).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    resumed = tmp_path / "resumed"
    proc = train_cli(resumed, *RUN, "--resume", str(crashed))
    assert "checkpoint refused" in proc.stderr and "round_000003" in proc.stderr
    rounds = M.read_metrics(resumed)
    assert [r[P.ROUND] for r in rounds] == [1, 2, 3, 4]  # 1-2 carried over, 3-4 run again
    assert rounds[:2] == M.read_metrics(straight_run)[:2]
    for g in (0, 1):
        assert_same_state(
            C.round_dir(straight_run / "checkpoints" / f"group_{g}", 4),
            C.round_dir(resumed / "checkpoints" / f"group_{g}", 4),
            tmp_path,
        )


def test_group_checkpoint_loads_onto_another_number_of_ranks(straight_run, tmp_path, corpus_dir):
    cfg = TrainConfig.from_json(straight_run / "config.json")
    one_rank = dataclasses.replace(cfg, nproc_per_group=1, resume=None)
    one_rank.to_json(tmp_path / "config.json")
    out_root = tmp_path / "resaved"
    torchrun(
        "reshard_check.py",
        2,
        tmp_path / "config.json",
        straight_run / "data",
        straight_run,
        "3",
        out_root,
        tmp_path,
    )
    for g in (0, 1):
        assert_same_state(
            C.round_dir(straight_run / "checkpoints" / f"group_{g}", 3),
            C.round_dir(out_root / "checkpoints" / f"group_{g}", 3),
            tmp_path,
        )
    meta = torch.load(
        C.round_dir(out_root / "checkpoints" / "group_0", 3) / C.GROUP_TRAINER, weights_only=False
    )
    assert meta["step"] == 6 and len(meta["data"]) == 1
    assert json.loads((straight_run / "config.json").read_text())["nproc_per_group"] == 2
