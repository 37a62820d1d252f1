"""The streaming transport through a real Flower deployment: SuperLink, nodes of different K,
aggregator processes, TLS; the global model checked against the groups' own weights.

The groups write their weights at each stage (--dump-dir): ``loaded`` after the round's pull
(the previous round's global model), ``trained`` before the push. Every round's global model,
as the next round's pull loads it, must be the token-weighted mean of the trained weights of
the groups that completed, within float32 rounding of an fp64 reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from flower_shard import protocol as P
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import free_port
from flower_shard.ux.metrics import read_metrics

SEQ, BATCH = 32, 2


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """TLS SuperLink, two nodes of K = 1 and K = 2 (node 1 reads faults from a file)."""
    work = tmp_path_factory.mktemp("streaming")
    dump = work / "dump"
    dump.mkdir()
    fault = work / "fault"
    with LocalDeployment(
        work,
        num_nodes=2,
        nproc_per_group=[1, 2],
        dump_dir=str(dump),
        fault_files=[None, str(fault)],
        tls=True,
    ) as dep:
        dep.dump, dep.fault = dump, fault
        yield dep


def run(dep, out, rounds=3, **extra):
    for f in dep.dump.iterdir():
        f.unlink()
    certs = dep.tls_files
    config = {
        P.NUM_SERVER_ROUNDS: rounds,
        P.LOCAL_STEPS: 2,
        P.OUT_DIR: str(out),
        P.MIN_GROUPS: 1,
        P.TRANSPORT: P.STREAMING,
        "model": "tiny",
        "seq-len": SEQ,
        "batch-size": BATCH,
        "seed": 3,
        "lr": 3e-3,
        "eval-sequences": 8,
        "aggregators": 2,
        "dataplane-certfile": str(certs.server_cert),
        "dataplane-keyfile": str(certs.server_key),
        "dataplane-ca-certfile": str(certs.ca_cert),
        P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
    } | extra
    summary = dep.run(config, timeout=600)
    assert summary["status"] == "ok", summary
    return read_metrics(out)


def dumped(dep, group, rnd, stage, dump=None):
    path = (dump or dep.dump) / f"g{group}_r{rnd}_{stage}.safetensors"
    return load_file(path) if path.exists() else None


@pytest.fixture(scope="module")
def float32_run(deployment, tmp_path_factory):
    """3 rounds in float32 with the pipelined commit: the exact-mean test's run, and the int8
    test's reference. Returns its out dir, its records and a copy of the groups' dumps."""
    out = tmp_path_factory.mktemp("float32")
    rounds = run(deployment, out)
    shutil.copytree(deployment.dump, out / "dump")
    return out, rounds, out / "dump"


def commits(out) -> list[dict[int, str]]:
    """Per aggregator, round -> how it committed (from its log: the pipelined fold kept, or
    folded again from the spools)."""
    import re

    found = []
    for path in sorted((out / "aggregators").glob("agg*.log")):
        lines = re.findall(r"round (\d+): committed groups \S+.*?, (.*)", path.read_text())
        found.append({int(r): how for r, how in lines})
    return found


def mean64(models, weights):
    total = float(sum(weights))
    return {
        k: sum(m[k].astype(np.float64) * (w / total) for m, w in zip(models, weights))
        for k in models[0]
    }


def test_each_round_is_the_token_weighted_mean_of_groups_of_different_k(deployment, float32_run):
    tmp_path, rounds, dump = float32_run
    assert [r["groups_ok"] for r in rounds] == [2, 2, 2], rounds
    # Tokens per group and round: steps x batch x seq x K (K = 1 and 2: weights 1 : 2).
    tokens = {g["group"]: g["tokens"] for g in rounds[0]["groups"]}
    assert sorted(tokens.values()) == [2 * BATCH * SEQ, 2 * BATCH * SEQ * 2]
    for rnd in (1, 2):
        trained = [dumped(deployment, g, rnd, "trained", dump) for g in sorted(tokens)]
        ref = mean64(trained, [tokens[g] for g in sorted(tokens)])
        for g in sorted(tokens):  # both groups start the next round from it
            loaded = dumped(deployment, g, rnd + 1, "loaded", dump)
            for k in ref:
                np.testing.assert_allclose(loaded[k], ref[k], rtol=0, atol=3e-6)
        # Both groups loaded the very same weights.
        a, b = (dumped(deployment, g, rnd + 1, "loaded", dump) for g in sorted(tokens))
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # The final model is what the aggregators hold after the last round (the groups evaluated
    # exactly it).
    final = load_file(tmp_path / "final_model.safetensors")
    evaluated = dumped(deployment, 0, 3, "evaluated", dump)
    assert all(np.array_equal(final[k], evaluated[k]) for k in evaluated)
    # Nothing but the ticket crossed Flower; the ranks streamed the weights.
    assert all(r["exchange_bytes"] == 0 and r["outer_sync_bytes"] > 0 for r in rounds)
    assert all(np.isfinite(r["eval_ppl"]) for r in rounds)
    # The groups pulled each round's model to evaluate it: that download is in the records.
    assert all(r[P.EVAL_PULL_S] > 0 for r in rounds), [r[P.EVAL_PULL_S] for r in rounds]
    # The groups keep their trainer from round to round (the ticket changes, the run does not):
    # the inner LR follows one schedule over the run. A group rebuilt every round reported the
    # same LR, its first round's, every round (and lost its AdamW state and data position).
    lrs = [r["lr"] for r in rounds]
    assert lrs[0] > lrs[1] > lrs[2] > 0, lrs
    # Pipelined: the groups followed every round while they pushed, and every commit kept the
    # fold they followed (so the models compared above came that way, checked "current").
    kept = {r: "the pipelined fold kept" for r in (1, 2, 3)}
    assert commits(tmp_path) == [kept, kept]
    # The ServerApp stopped the aggregators it started (their work dirs are under out-dir).
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    mine = [line for line in ps.splitlines() if "dataplane.aggregator" in line]
    assert not [line for line in mine if str(tmp_path) in line], mine


def test_a_group_that_claims_1e30_tokens_is_refused_and_not_waited_for(deployment, tmp_path):
    """In rounds 1 and 2 node 1's replies claim 1e30 tokens (its streams declared the true
    count): refused both times. Round 1 waited for its streams, so the commit folds the other
    group again from the spools; round 2 does not wait for a group left out the round before,
    so the pipelined fold is kept; honest again in round 3, it is accepted (folded from the
    spools: it was not waited for). Every round's model is the mean of the accepted groups.
    (A group killed mid-upload: the overlapped test below.)"""
    deployment.fault.write_text("1:weight-1e30,2:weight-1e30")
    try:
        rounds = run(deployment, tmp_path)
    finally:
        deployment.fault.unlink()
    assert [r["groups_ok"] for r in rounds] == [1, 1, 2], rounds
    for r in rounds[:2]:
        assert r["groups_rejected"] == 1 and "num_tokens" in " | ".join(r["rejected"]), r
    (honest,) = [g["group"] for g in rounds[0]["groups"]]
    for rnd in (1, 2):  # the honest group alone: its own weights
        trained = dumped(deployment, honest, rnd, "trained")
        loaded = dumped(deployment, honest, rnd + 1, "loaded")
        for k in trained:
            np.testing.assert_allclose(loaded[k], trained[k], rtol=0, atol=3e-6)
    tokens = {g["group"]: g["tokens"] for g in rounds[2]["groups"]}
    trained = [dumped(deployment, g, 3, "trained") for g in sorted(tokens)]
    ref = mean64(trained, [tokens[g] for g in sorted(tokens)])
    final = load_file(tmp_path / "final_model.safetensors")
    for k in ref:
        np.testing.assert_allclose(final[k], ref[k], rtol=0, atol=3e-6)
    for c in commits(tmp_path):
        assert [c[r] for r in (1, 2, 3)] == [
            "folded from the spools",
            "the pipelined fold kept",
            "folded from the spools",
        ], c


def test_int8_both_ways_trains_like_float32(deployment, float32_run, tmp_path):
    """The same run as the float32 one, int8 both ways, pipelined. (The synchronous path,
    pipelined-commit off, runs in tests/test_flower.py's simulation-mode test.)"""
    _, base, _ = float32_run
    int8 = run(
        deployment,
        tmp_path,
        compression="int8",
        **{"downlink-compression": "int8", "compression-chunk": 256},
    )
    assert [r["groups_ok"] for r in int8] == [2, 2, 2]
    kept = {r: "the pipelined fold kept" for r in (1, 2, 3)}
    assert commits(tmp_path) == [kept, kept]
    # Uplink: 1 byte per value plus a float32 scale per 256.
    ratio = int8[-1]["outer_sync_bytes"] / base[-1]["outer_sync_bytes"]
    assert 0.25 < ratio < 0.28, ratio
    gap = abs(int8[-1]["eval_ppl"] / base[-1]["eval_ppl"] - 1)
    assert gap < 0.02, gap


def fold(base, updates, tokens):
    """The aggregators' fedavg step, in their float32 operations: ``base - sum_g f32(w_g / W)
    (base - s_g)``, the groups in order."""
    total = float(sum(tokens))
    out = {}
    for k in base:
        acc = np.zeros_like(base[k])
        for s, w in zip(updates, tokens):
            acc = acc + np.float32(w / total) * (base[k] - s[k])
        out[k] = base[k] - acc
    return out


def rebased(trained, new_global, sent):
    """The overlapped rule's rebase, in float32: ``theta + (X - s)``."""
    return {k: trained[k] + (new_global[k] - sent[k]) for k in trained}


def test_overlapped_rounds_follow_the_delayed_rule_exactly_also_when_a_group_dies(
    deployment, tmp_path
):
    """outer-overlap, 5 rounds (the 5th drains). Round 1 holds the updates back; in round r a
    group pushes what it sent at the end of round r - 1 while it trains round r, and before it
    trains moves by ``X - s`` (the global model that came back for what it sent). Node 1's
    group dies mid-push in round 3: round 3 folds the other group alone; the restarted group
    pulls that model, holds its update back in round 4 (not waited for), and drains it with
    round 5's. Every rebased model and the final model are the rule's, bit for bit, from the
    groups' trained weights; where no group was lost the download came while the groups
    uploaded (the confirming downloads carry no values)."""
    deployment.fault.write_text("3:die-upload")
    try:
        rounds = run(
            deployment, tmp_path, rounds=5, **{P.OUTER_OVERLAP: True, "round-timeout": 120.0}
        )
    finally:
        deployment.fault.unlink()
    assert [r["groups_ok"] for r in rounds] == [2, 2, 1, 2, 2], rounds
    per = {g["group"]: g["tokens"] for g in rounds[0]["groups"]}  # one round's steps
    (live,) = [g["group"] for g in rounds[2]["groups"]]
    (died,) = set(per) - {live}
    # The records count the tokens folded: none in round 1, both rounds' in the drain.
    folded = [0, per[0] + per[1], per[live], per[live], 2 * (per[0] + per[1])]
    assert [r["tokens"] for r in rounds] == list(np.cumsum(folded)), rounds

    def dump(g, rnd, stage):
        return dumped(deployment, g, rnd, stage)

    def same(a, b):
        return all(np.array_equal(a[k], b[k]) for k in b)

    x = dump(live, 1, "loaded")  # the first global model; round 1 commits nothing
    sent = {g: dump(g, 1, "trained") for g in per}  # round 2 sends round 1's weights as trained
    assert all(same(dump(g, 2, "rebased"), sent[g]) for g in per)
    x = fold(x, [sent[g] for g in sorted(per)], [per[g] for g in sorted(per)])  # round 2's
    sent = {g: rebased(dump(g, 2, "trained"), x, sent[g]) for g in per}
    assert all(same(dump(g, 3, "rebased"), sent[g]) for g in per)
    x = fold(x, [sent[live]], [per[live]])  # round 3: the live group alone
    assert same(dump(died, 4, "loaded"), x)  # the restarted group starts from it
    sent = {live: rebased(dump(live, 3, "trained"), x, sent[live])}
    assert same(dump(live, 4, "rebased"), sent[live])
    x = fold(x, [sent[live]], [per[live]])  # round 4: the restarted group held back
    sent[live] = rebased(dump(live, 4, "trained"), x, sent[live])
    assert same(dump(live, 5, "rebased"), sent[live])
    assert same(dump(died, 5, "rebased"), dump(died, 4, "trained"))  # nothing sent yet
    x = fold(x, [dump(g, 5, "trained") for g in sorted(per)], [2 * per[g] for g in sorted(per)])
    final = load_file(tmp_path / "final_model.safetensors")
    assert all(same(model, x) for model in [final, *(dump(g, 5, "evaluated") for g in per)])
    # Rounds 2, 4 and 5 kept the fold the ranks followed while they pushed (round 4 did not
    # wait for the group that held its update back), so the live group's confirming downloads
    # of rounds 3 and 5 carry no values: its new model came while it uploaded. (Round 3 keeps
    # its fold too when every aggregator dropped the dead group's streams alike.)
    kept = {r: "the pipelined fold kept" for r in (2, 4, 5)}
    assert [{r: c[r] for r in kept} for c in commits(tmp_path)] == [kept, kept]
    lines = [
        line
        for path in (tmp_path / "aggregators").glob("*/streams.jsonl")
        for line in map(json.loads, path.read_text().splitlines())
    ]
    hidden = [
        s for s in lines if s["kind"] == "download" and s["group"] == live and s["round"] in (3, 5)
    ]
    # node 0's one rank x 2 aggregators x (the confirms of rounds 3 and 5, round 5's evaluation)
    assert len(hidden) == 6 and all(s["frames"] == 0 for s in hidden), hidden
