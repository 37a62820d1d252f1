"""The streaming data plane with real aggregator processes on loopback: the exact weighted mean,
hostile streams, a late stream of an older round, compression both ways, TLS, and an
aggregator's checkpoint."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from dataplane_util import (
    SHAPES,
    HeldValues,
    download_all,
    pool,
    shard_pieces,
    ticket,
    upload_group,
)

from flower_shard.dataplane import streamlog, tickets, wire
from flower_shard.dataplane.client import DataPlaneError, RankLink, UplinkEncoder
from flower_shard.dataplane.layout import Layout
from flower_shard.dataplane.pool import AggregatorPool

__all__ = ["pool"]  # the fixture, used by name
LOG = streamlog.FILE_NAME


def test_weighted_mean_of_groups_with_different_k_equals_the_fp64_reference(pool, tmp_path):
    p, layout = pool(count=2)
    p.begin(1)
    mode, w0 = download_all(p, layout, 1, 0)
    assert mode == "full"
    rng = np.random.default_rng(0)
    deltas = [
        {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in SHAPES.items()}
        for _ in range(3)
    ]
    weights = [4096.0, 2048.0, 6144.0]
    for g, (d, k, w) in enumerate(zip(deltas, (1, 2, 3), weights)):
        upload_group(p, layout, 1, g, d, k, w)
    status = p.status()
    assert all(all(s["complete"] for s in st) for st in status.values())
    # The squared norms the ServerApp's outlier rule reads: exact on every aggregator's part.
    for g, d in enumerate(deltas):
        sq = sum(s["sq_norm"] for s in status[g])
        assert sq == pytest.approx(
            sum(float((v.astype(np.float64) ** 2).sum()) for v in d.values())
        )
    p.commit(1, dict(enumerate(weights)))
    p.begin(2)
    _, new = download_all(p, layout, 2, 0)
    # Every stream is on its aggregator's stream log, with the float32 payload it carried.
    lines = [x for i in range(2) for x in streamlog.read(tmp_path / "agg0" / f"agg{i}" / LOG)]
    numel = sum(int(np.prod(s)) for s in SHAPES.values())
    for g, k in enumerate((1, 2, 3)):
        up = [x for x in lines if x["kind"] == "upload" and x["group"] == g]
        assert sorted({x["rank"] for x in up}) == list(range(k))
        assert all(x["outcome"] == "ok" and x["round"] == 1 and x["start"] <= x["end"] for x in up)
        assert sum(x["bytes"] - x["frames"] * wire.HEADER.size for x in up) == 4 * numel
    down = [x for x in lines if x["kind"] == "download" and x["round"] == 2]
    assert sum(x["bytes"] - x["frames"] * wire.HEADER.size for x in down) == 4 * numel
    total = sum(weights)
    for n in SHAPES:
        ref = w0[n].astype(np.float64) - sum(
            w / total * d[n].astype(np.float64) for w, d in zip(weights, deltas)
        )
        np.testing.assert_allclose(new[n], ref, rtol=0, atol=2e-6 * (1 + np.abs(ref).max()))
    # Repeated with the groups arriving in the opposite order: the same bits (fold in group order).
    q, _ = pool(count=2)
    q.begin(1)
    for g in reversed(range(3)):
        upload_group(q, layout, 1, g, deltas[g], (1, 2, 3)[g], weights[g])
    q.commit(1, dict(enumerate(weights)))
    q.begin(2)
    _, again = download_all(q, layout, 2, 0)
    assert all(np.array_equal(again[n], new[n]) for n in SHAPES)


def test_hostile_streams_are_refused_and_only_that_group_is_dropped(pool, tmp_path):
    p, layout = pool(count=1)
    p.begin(3)
    good = {n: np.full(s, 0.5, np.float32) for n, s in SHAPES.items()}
    # A stream with another round's token (a replay), or another group's: refused at once.
    stale = tickets.Ticket(
        "run-1", 3, 1, tickets.group_token(p.secret, "run-1", 2, 1), tuple(p.addresses), False
    )
    with pytest.raises(DataPlaneError, match="wrong token"):
        RankLink(stale, 0).upload(
            shard_pieces(layout, good, 1, 0), layout, 10.0, UplinkEncoder("none", 64)
        )
    bad_frames = {
        2: lambda: [wire.encode_chunk(99, 0, np.ones(4, np.float32), "none", 64)],  # unknown param
        3: lambda: [wire.encode_chunk(1, 200, np.ones(40, np.float32), "none", 64)],  # out of range
        4: lambda: [wire.encode_chunk(0, 0, np.ones(8, np.float32), "none", 64)] * 2,  # twice
        5: lambda: [wire.encode_chunk(0, 0, np.ones(8, np.float32), "none", 64)[:-4]],  # size
        6: lambda: [wire.encode_chunk(0, 0, np.array([1, np.nan], np.float32), "none", 64)],
    }
    good_frame = wire.encode_chunk(0, 0, np.ones(8, np.float32), "none", 64)
    bad_weights = {7: "heavy", 8: -1.0, 9: 0, 10: float("inf"), 11: [10.0], 12: True}
    bad_frames |= {g: lambda: [good_frame] for g in bad_weights}
    reasons = {}
    for group, make in bad_frames.items():
        t = ticket(p, 3, group)
        head = {
            "run": "run-1",
            "round": 3,
            "group": group,
            "rank": 0,
            "weight": bad_weights.get(group, 10.0),
            "token": tickets.rank_token(t.token, 0),
            "compression": "none",
        }
        link = RankLink(t, 0)
        call = link.channels[0].stream_unary(f"/{wire.SERVICE}/{wire.UPLOAD}")
        reasons[group] = wire.from_json(call(iter([wire.to_json(head), *make()])))
        link.close()
    assert all(not r["ok"] for r in reasons.values())
    assert "not held" in reasons[2]["reason"] and "outside" in reasons[3]["reason"]
    assert "twice" in reasons[4]["reason"] and "bytes, expected" in reasons[5]["reason"]
    assert "non-finite" in reasons[6]["reason"]
    assert all("not a finite positive number" in reasons[g]["reason"] for g in bad_weights)
    logged = {x["group"]: x for x in streamlog.read(tmp_path / "agg0" / "agg0" / LOG)}
    assert all(logged[g]["outcome"] == reasons[g]["reason"] for g in bad_frames)
    assert "wrong token" in logged[1]["outcome"]
    upload_group(p, layout, 3, 0, good, 2, 10.0)
    status = p.status()
    assert status[0][0]["complete"] and all(status[g][0]["rejected"] for g in bad_frames)
    with pytest.raises(DataPlaneError, match="did not complete"):
        p.commit(3, {0: 10.0, 6: 10.0})
    p.commit(3, {0: 10.0})


def test_a_stream_of_an_older_round_touches_nothing_of_the_next(pool):
    """Rank 1 of group 0 is still streaming round 1 when round 1 commits without its group and
    round 2 begins; its next chunk (a NaN) is refused, and nothing of round 2 moves: group 0's
    round-2 upload stands, and the model is bit for bit that of an aggregator that never saw
    the late stream."""
    p, layout = pool(count=1)
    q, _ = pool(count=1)
    rng = np.random.default_rng(3)
    deltas = [
        {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in SHAPES.items()}
        for _ in range(4)
    ]
    release = threading.Event()
    late = shard_pieces(layout, deltas[0], 2, 1)
    index, start, values = late[-1]
    poisoned = values.copy()
    poisoned[0] = np.nan
    late[-1] = (index, start, HeldValues(poisoned, release.is_set))
    errors = []

    def straggler():  # rank 1 of group 0, round 1: its last piece comes only after release
        link = RankLink(ticket(p, 1, 0), 1)
        try:
            link.upload(late, layout, 4096.0, UplinkEncoder("none", 64))
        except DataPlaneError as exc:
            errors.append(str(exc))
        finally:
            link.close()

    for x in (p, q):
        x.begin(1)
    thread = threading.Thread(target=straggler, daemon=True)
    thread.start()
    for x in (p, q):
        upload_group(x, layout, 1, 1, deltas[1], 1, 2048.0)
    deadline = time.monotonic() + 30
    while not p.status().get(0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.status()[0][0]["received"] > 0  # the straggler's first pieces are in
    for x in (p, q):
        x.commit(1, {1: 2048.0})
        x.begin(2)
        for g, d in ((0, deltas[2]), (1, deltas[3])):
            upload_group(x, layout, 2, g, d, 2, 4096.0)
    release.set()
    thread.join(60)
    assert not thread.is_alive() and len(errors) == 1, errors
    assert "non-finite" in errors[0] or "round is over" in errors[0], errors
    assert p.status()[0][0]["complete"]  # round 2's upload of group 0 stands
    for x in (p, q):
        x.commit(2, {0: 4096.0, 1: 4096.0})
    link = RankLink(ticket(p, 2, 0), 0)  # a stream of the committed round is refused
    try:
        with pytest.raises(DataPlaneError, match="committed or over"):
            pieces = shard_pieces(layout, deltas[2], 1, 0)
            link.upload(pieces, layout, 4096.0, UplinkEncoder("none", 64))
    finally:
        link.close()
    for x in (p, q):
        x.begin(3)
    (_, seen), (_, clean) = download_all(p, layout, 3, 0), download_all(q, layout, 3, 0)
    assert all(np.array_equal(seen[n], clean[n]) for n in SHAPES)


def test_int8_both_ways_with_error_feedback_and_a_checkpoint(pool, tmp_path):
    p, layout = pool(count=2, uplink="int8", downlink="int8", outer="nesterov")
    have, model = -1, None
    rng = np.random.default_rng(3)
    for rnd in (1, 2, 3):
        p.begin(rnd)
        mode, got = download_all(p, layout, rnd, 0, have)
        if model is None:
            assert mode == "full"
            model = got
        else:
            assert mode == "delta"
            model = {n: model[n] + got[n] for n in SHAPES}  # the group's view advances
        have = rnd - 1
        delta = {n: rng.standard_normal(s).astype(np.float32) * 0.01 for n, s in SHAPES.items()}
        upload_group(p, layout, rnd, 0, delta, 2, 100.0, kind="int8")
        p.commit(rnd, {0: 100.0})
    p.begin(4)
    # A group out of step (or new) gets the full view: what the in-step group holds.
    mode, full = download_all(p, layout, 4, 1, have=0)
    assert mode == "full"
    _, step = download_all(p, layout, 4, 0, have)
    assert all(np.array_equal(model[n] + step[n], full[n]) for n in SHAPES)
    p.save(tmp_path / "ckpt")
    q, _ = pool(count=2, uplink="int8", downlink="int8", outer="nesterov")
    q.load(tmp_path / "ckpt")
    q.begin(4)
    mode, loaded = download_all(q, layout, 4, 0, have)
    assert mode == "full" and all(np.array_equal(loaded[n], full[n]) for n in SHAPES)


@pytest.mark.parametrize(
    # HSDP's first pull is a synchronous one; its second comes from following the round
    "sharding,nproc,follow",
    [("fsdp", 2, False), ("hsdp", 4, True)],
)
def test_a_torchrun_group_pulls_into_its_shards_and_pushes_its_pseudo_gradient(
    tmp_path, sharding, nproc, follow
):
    """Real FSDP2/HSDP shards: the pull replaces the group's own init with the aggregators'
    global model, the push of ``view - local`` gives the group's weights back after a commit
    (one group, fedavg: w - (w - x) = x, exact for x = w / 2), and the second pull loads them.
    Following the round (pipelined commit): the new weights came while it pushed, into the
    view; the second pull is answered ``current`` and loads them from there (HSDP: replica 0
    followed and shares them with the other replicas). HSDP then runs an overlapped round's
    primitives: snapshot, push from it, confirm, rebase on every replica."""
    import json
    import threading
    import time

    import torch
    from conftest import torchrun

    from flower_shard.dataplane.init import parameter_shapes

    layout = Layout.build(parameter_shapes("tiny", 257, 32), 2)
    (tmp_path / "layout.json").write_text(json.dumps(layout.to_json()))
    p = AggregatorPool.start_local(2, "127.0.0.1", tmp_path / "agg", None, None)
    try:
        settings = {
            "uplink": "none",
            "downlink": "none",
            "scale_chunk": 2048,
            "outer": "fedavg",
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        }
        init = {"kind": "model", "model": "tiny", "vocab_size": 257, "seed": 0, "seq_len": 32}
        p.configure("run-1", layout, settings, init)
        p.begin(1)
        if follow:
            p.expect(1, [0])
        _, w0 = download_all(p, layout, 1, 5)
        how = "follow" if follow else "sync"
        args = (",".join(p.addresses), p.secret, 1, sharding, how, tmp_path)  # the log dir last
        seen = []

        def server_side():  # the ServerApp's part, while the group runs in the foreground
            deadline = time.monotonic() + 240
            while not (tmp_path / "pushed").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            seen.append(p.status())
            p.commit(1, {0: 100.0})
            p.begin(2)
            if not follow:
                (tmp_path / "next").touch()
                return
            p.expect(2, [0])  # then an overlapped round (HSDP): group 1 is not waited for
            (tmp_path / "next").touch()
            while not (tmp_path / "pushed2").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            zeros = {q.name: np.zeros(q.shape, np.float32) for q in layout.params}
            upload_group(p, layout, 2, 1, zeros, 1, 100.0)
            p.commit(2, {0: 100.0, 1: 100.0})  # not the fold group 0 followed
            p.begin(3)
            p.expect(3, [0])  # a follower of round 3 waits for group 0, which never uploads
            (tmp_path / "next2").touch()

        server = threading.Thread(target=server_side, daemon=True)
        server.start()
        torchrun("dataplane_rank_check.py", nproc, *args, timeout=300)
        server.join(timeout=10)
        assert all(s["complete"] and s["weight"] == 100.0 for s in seen[0][0]), seen
    finally:
        p.stop()
    first = torch.load(tmp_path / "first.pt")
    second = torch.load(tmp_path / "second.pt")
    assert first["mode"] == "full" and second["mode"] == ("current" if follow else "full")
    for name in [q.name for q in layout.params]:
        assert np.array_equal(first["pulled"][name].numpy(), w0[name]), name
        assert torch.equal(second["pulled"][name], first["moved"][name]), name
    if not follow:
        return
    # The overlapped round: it pushed view - s from its snapshot s while its shards had moved
    # on; round 2 committed with a second group (zeros), not what it followed, so the confirm
    # brought the committed model as a full snapshot, and both replicas rebased onto it:
    # theta + (X - s), X = V - (0.5 (V - s) + 0.5 x 0) in the aggregators' float32 steps.
    for rank in (0, nproc - 1):
        third = torch.load(tmp_path / f"third_{rank}.pt")
        assert third["mode"] == ("full" if rank == 0 else "none")  # replica 1 got it from 0
        for name in [q.name for q in layout.params]:
            v, s = second["pulled"][name].numpy(), third["sent"][name].numpy()
            acc = np.float32(0.5) * (v - s) + np.float32(0.5) * np.zeros_like(v)
            want = third["trained"][name].numpy() + ((v - acc) - s)
            assert np.array_equal(third["rebased"][name].numpy(), want), (rank, name)
            assert not np.array_equal(want, third["trained"][name].numpy()), name
        # forget() cut off the follower at once (its aggregators would have waited 600 s)
        # and the view is known to hold nothing: the next round pulls a full snapshot
        assert third["cut_s"] < 60 and third["have_round"] == -1, third["cut_s"]
