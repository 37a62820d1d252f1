"""Checkpoints: atomic, verified directories; exact resume; loading onto another number of ranks."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

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
    C.write_identity(tmp, {"run-name": "r", "group-index": None})
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
    with pytest.raises(ConfigError, match="--checkpoint-every must be an integer in \\[0"):
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
    resaved = C.round_dir(out_root / "checkpoints" / "group_0", 3)
    meta = json.loads((resaved / C.GROUP_TRAINER).read_text())
    assert meta["step"] == 6 and len(meta["data"]) == 1
    # The resaved checkpoint carries on the identity of the one it loaded.
    source = C.round_dir(straight_run / "checkpoints" / "group_0", 3)
    assert C.read_identity(resaved) == C.read_identity(source)
    assert json.loads((straight_run / "config.json").read_text())["nproc_per_group"] == 2


# -- what verification refuses, and what loading never runs ----------------------------------------


def _rewrite_manifest(path):
    """What an attacker who can write a checkpoint does after changing it: a fresh manifest."""
    import hashlib

    manifest = json.loads((path / C.MANIFEST).read_text())
    for name in manifest["files"]:
        blob = (path / name).read_bytes()
        manifest["files"][name] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (path / C.MANIFEST).write_text(json.dumps(manifest))


def test_verify_refuses_empty_partial_unlisted_and_linked_entries(tmp_path):
    good = _write(tmp_path / "a", 1, b"x" * 100)
    assert C.verify(good) is None
    cases = {}
    for case in ("empty", "partial", "unlisted", "linked-file", "linked-dir", "linked-group"):
        shutil.copytree(tmp_path / "a", tmp_path / case)
        cases[case] = C.round_dir(tmp_path / case, 1)
    (cases["empty"] / C.MANIFEST).write_text(json.dumps({"round": 1, "files": {}}))
    manifest = json.loads((cases["partial"] / C.MANIFEST).read_text())
    del manifest["files"][C.IDENTITY]  # a manifest that leaves out what a checkpoint must hold
    (cases["partial"] / C.IDENTITY).unlink()
    (cases["partial"] / C.MANIFEST).write_text(json.dumps(manifest))
    (cases["unlisted"] / "extra.bin").write_bytes(b"added afterwards")
    target = tmp_path / "elsewhere.bin"
    target.write_bytes((good / "data.bin").read_bytes())
    (cases["linked-file"] / "data.bin").unlink()
    (cases["linked-file"] / "data.bin").symlink_to(target)
    shutil.rmtree(cases["linked-dir"])
    cases["linked-dir"].symlink_to(good, target_is_directory=True)
    shutil.rmtree(tmp_path / "linked-group")
    (tmp_path / "linked-group").symlink_to(tmp_path / "a", target_is_directory=True)
    expected = {
        "empty": "lists no files",
        "partial": "partial manifest",
        "unlisted": "extra.bin is not in its MANIFEST.json",
        "linked-file": "data.bin is a symbolic link",
        "linked-dir": "a symbolic link",
        "linked-group": "a symbolic link",
    }
    for case, path in cases.items():
        reason = C.verify(path)
        assert reason is not None and expected[case] in reason, (case, reason)
    assert C.latest_good(tmp_path / "linked-group", log=lambda _m: None) is None


def test_dcp_metadata_is_read_without_running_code(tmp_path, monkeypatch):
    """A tampered ``.metadata`` (DCP's index, a pickle) with a rewritten manifest verifies, but
    reading it refuses what is not a DCP record, and its payload never runs."""
    import os

    from flower_shard.errors import CheckpointError
    from flower_shard.runtime.group_checkpoint import check_metadata

    pwned = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    import pickle

    path = tmp_path / "ck"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        check_metadata(path)
    assert not pwned.exists()


# -- resume and new runs against the straight run's directory (no rank starts) ---------------------


def _cli_error(*args) -> str:
    """`flower-shard train ARGS` that must fail before launch: its one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "train", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flower-shard: error:"), proc.stderr
    return lines[0]


def test_a_new_run_into_a_run_directory_is_refused(straight_run):
    before = {g: C.rounds(straight_run / "checkpoints" / g) for g in ("group_0", "group_1")}
    line = _cli_error("--out", straight_run, *RUN)
    assert "holds the checkpoints of another run" in line and f"--resume {straight_run}" in line
    after = {g: C.rounds(straight_run / "checkpoints" / g) for g in ("group_0", "group_1")}
    assert before == after and after["group_0"] == [4, 3, 2]  # nothing pruned, nothing added


def test_resume_refuses_changed_settings_other_runs_and_linked_groups(straight_run, tmp_path):
    # A setting that shapes the training: refused before anything starts.
    line = _cli_error("--out", tmp_path / "lr", *RUN, "--lr", "0.002", "--resume", straight_run)
    assert "resume: lr is 0.002 but the run" in line
    assert not (tmp_path / "lr" / "config.json").exists()
    # Group 1's newest checkpoint swapped for one of another run (manifest made to match).
    other = tmp_path / "other"
    shutil.copytree(straight_run, other)
    swapped = C.round_dir(other / "checkpoints" / "group_1", 4)
    identity = C.read_identity(swapped) | {"run-name": "another-run"}
    C.write_identity(swapped, identity)
    _rewrite_manifest(swapped)
    line = _cli_error("--out", tmp_path / "o", *RUN, "--resume", other)
    assert "checkpoint of another run" in line
    # Group 1's directory a link to group 0's: refused, not loaded as group 1.
    linked = tmp_path / "linked"
    shutil.copytree(straight_run, linked)
    shutil.rmtree(linked / "checkpoints" / "group_1")
    (linked / "checkpoints" / "group_1").symlink_to(linked / "checkpoints" / "group_0")
    line = _cli_error("--out", tmp_path / "l", *RUN, "--resume", linked)
    assert "symbolic link" in line
    # Group 0's checkpoints copied over group 1's: they say group 0.
    copied = tmp_path / "copied"
    shutil.copytree(straight_run, copied)
    shutil.rmtree(copied / "checkpoints" / "group_1")
    shutil.copytree(copied / "checkpoints" / "group_0", copied / "checkpoints" / "group_1")
    line = _cli_error("--out", tmp_path / "c", *RUN, "--resume", copied)
    assert "group 0's checkpoint, not group 1's" in line


def test_a_pickle_in_a_checkpoint_never_runs_on_resume(straight_run, tmp_path):
    """The attack of issue 15: a checkpoint file replaced by a pickle that runs code, its
    checksum rewritten in the manifest. Resume refuses it in one line; the code never runs."""
    import os
    import pickle

    pwned = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    tampered = tmp_path / "tampered"
    shutil.copytree(straight_run, tampered)
    for g in (0, 1):
        for rnd in C.rounds(tampered / "checkpoints" / f"group_{g}"):
            path = C.round_dir(tampered / "checkpoints" / f"group_{g}", rnd)
            (path / ".metadata").write_bytes(pickle.dumps(Payload()))
            _rewrite_manifest(path)
            assert C.verify(path) is None  # the manifest alone cannot tell
    line = _cli_error("--out", tmp_path / "resumed", *RUN, "--resume", tampered)
    assert "not a checkpoint record" in line
    assert not pwned.exists()
