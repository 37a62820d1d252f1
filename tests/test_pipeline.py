"""The pipelined commit with real aggregator processes on loopback: ranks that follow a round get
each parameter's new values before the commit, bit for bit the committed model (float32, bf16
and int8 downlinks, fedavg and nesterov, groups of different K); a group the commit will refuse
(a refused upload, a weight beyond the bound or not a number) is not waited for; one rejected
after a fold, silent, or screened out voids what they followed, and the commit is then the mean
of the others."""

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

from flower_shard.dataplane import tickets, wire
from flower_shard.dataplane.client import DataPlaneError, RankLink, UplinkEncoder

__all__ = ["pool"]  # the fixture, used by name

KS = (1, 2, 3)  # ranks per group
WEIGHTS = {0: 4096.0, 1: 2048.0, 2: 6144.0}


class Follower:
    """Rank ``s`` of ``k`` of ``group`` following round ``rnd`` in a thread."""

    def __init__(self, p, layout, rnd, group, k, s, have=-1, provisional=False):
        zeros = {n: np.zeros(shape, np.float32) for n, shape in SHAPES.items()}
        ranges = [(i, a, a + v.size) for i, a, v in shard_pieces(layout, zeros, k, s)]
        self.mode, self.values, self.error, self.group = None, None, None, group

        def run():
            link = RankLink(ticket(p, rnd, group), s)
            try:
                got = link.download(ranges, layout, have, follow=True, provisional=provisional)
                self.mode, _, self.values = got
            except DataPlaneError as exc:
                self.error = str(exc)
            finally:
                link.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self, seconds: float = 60.0) -> Follower:
        self.thread.join(seconds)
        return self


def assemble(followers, layout, base=None):
    """The whole model from the ranks' followed pieces (added to ``base`` for a delta)."""
    out = {n: np.full(int(np.prod(s)), np.nan, np.float32) for n, s in SHAPES.items()}
    for f in followers:
        for (i, a), v in f.values.items():
            out[layout.params[i].name][a : a + v.size] = v
    out = {n: v.reshape(SHAPES[n]) for n, v in out.items()}
    return {n: base[n] + out[n] for n in out} if base is not None else out


def updates(seed):
    rng = np.random.default_rng(seed)
    return [
        {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in SHAPES.items()} for _ in KS
    ]


def pull_mode(p, layout, rnd, have, provisional=True):
    """The mode a rank of group 0 that followed round ``have`` is answered in round ``rnd``."""
    link = RankLink(ticket(p, rnd, 0), 0)
    try:
        ranges = [(q.index, 0, q.numel) for q in layout.params]
        return link.download(ranges, layout, have, provisional=provisional)[:2]
    finally:
        link.close()


def follow_all(p, layout, rnd, have, groups=(0, 1, 2), provisional=False):
    return {
        g: [Follower(p, layout, rnd, g, KS[g], s, have, provisional) for s in range(KS[g])]
        for g in groups
    }


@pytest.mark.parametrize(
    "downlink,outer", [("none", "fedavg"), ("int8", "nesterov"), ("bf16", "fedavg")]
)
def test_followers_get_the_committed_model_before_the_commit_bit_for_bit(pool, downlink, outer):
    p, layout = pool(count=2, downlink=downlink, outer=outer)  # pipelined
    q, _ = pool(count=2, downlink=downlink, outer=outer)  # the synchronous reference
    for x in (p, q):
        x.begin(1)
    _, model = download_all(q, layout, 1, 0)  # the initial model: round 1 comes as a delta
    have = 0
    for rnd in (1, 2, 3):
        for x in (p, q):
            x.begin(rnd)
        p.expect(rnd, list(WEIGHTS))
        # from round 2 what they hold was followed (kept: still a delta)
        followers = follow_all(p, layout, rnd, have, provisional=rnd > 1)
        everyone = [f for fs in followers.values() for f in fs]
        time.sleep(0.5)
        assert all(f.thread.is_alive() for f in everyone)  # nothing to give before the uploads
        for g, d in enumerate(updates(rnd)):
            for x in (p, q):
                upload_group(x, layout, rnd, g, d, KS[g], WEIGHTS[g])
        for f in everyone:  # all of it before the commit
            assert not f.wait().thread.is_alive() and f.error is None, f.error
        q.commit(rnd, WEIGHTS)
        q.begin(rnd + 1)
        mode, got = download_all(q, layout, rnd + 1, 0, have)
        ref = got if mode == "full" else {n: model[n] + got[n] for n in SHAPES}
        assert {f.mode for f in everyone} == {mode}
        for fs in followers.values():  # every group holds the reference's model, bit for bit
            held = assemble(fs, layout, None if mode == "full" else model)
            for n in SHAPES:
                np.testing.assert_array_equal(held[n], ref[n])
        assert p.commit(rnd, WEIGHTS)  # every aggregator kept the fold
        model, have = ref, rnd
        p.begin(rnd + 1)
        assert pull_mode(p, layout, rnd + 1, have) == ("current", rnd)  # kept as followed


def bad_upload(p, rnd, group, frame, owner=0):
    """Rank 0 of ``group`` sends ``frame`` to aggregator ``owner`` (refused: the group is
    rejected there)."""
    link = RankLink(ticket(p, rnd, group), 0)
    head = {
        "run": "run-1",
        "round": rnd,
        "group": group,
        "rank": 0,
        "weight": WEIGHTS[group],
        "token": tickets.rank_token(link.ticket.token, 0),
        "compression": "none",
    }
    call = link.channels[owner].stream_unary(f"/{wire.SERVICE}/{wire.UPLOAD}")
    try:
        return wire.from_json(call(iter([wire.to_json(head), frame])))
    finally:
        link.close()


def cut_short_upload(p, layout, rnd, group, deltas):
    """Rank 0 of ``group`` sends each aggregator the first chunk of one of its parameters and
    ends its streams as a rank that died may seem to, normally but without the end mark: both
    drop the group."""
    for owner in (0, 1):
        param = next(q for q in layout.params if q.owner == owner)
        chunk = wire.encode_chunk(param.index, 0, deltas[param.name].reshape(-1)[:2], "none", 64)
        reply = bad_upload(p, rnd, group, chunk, owner)
        assert not reply["ok"] and "without its end mark" in reply["reason"], reply


def refused_upload(p, layout, rnd, group, deltas):
    """Rank 0 of ``group`` streams a NaN to one aggregator and, slowly, a good piece to the
    other: the first refuses the group, and the rank cancels its stream to the second."""
    first, second = (next(q for q in layout.params if q.owner == o) for o in (0, 1))
    bad = deltas[first.name].reshape(-1).copy()
    bad[1] = np.nan

    def refused():  # by the first aggregator (the rank has its answer right after)
        return (p.status().get(group) or [{}])[0].get("rejected") is not None

    slow = HeldValues(deltas[second.name].reshape(-1), refused)
    link = RankLink(ticket(p, rnd, group), 0)
    try:
        with pytest.raises(DataPlaneError, match="non-finite"):
            link.upload(
                [(first.index, 0, bad), (second.index, 0, slow)],
                layout,
                WEIGHTS[group],
                UplinkEncoder("none", 64),
            )
    finally:
        link.close()


def refused_late_upload(p, layout, rnd, group, deltas):
    """Rank 0 of ``group`` ends its stream to the second aggregator normally first, then the
    first refuses its NaN: the rank withdraws the ended upload after the fact."""
    first, second = (next(q for q in layout.params if q.owner == o) for o in (0, 1))
    bad = deltas[first.name].reshape(-1).copy()
    bad[1] = np.nan
    good = deltas[second.name].reshape(-1)

    def sent():  # the whole piece reached the second aggregator
        return (p.status().get(group) or [{}, {}])[1].get("received") == good.size

    link = RankLink(ticket(p, rnd, group), 0)
    try:
        with pytest.raises(DataPlaneError, match="non-finite"):
            link.upload(
                [(first.index, 0, HeldValues(bad, sent)), (second.index, 0, good)],
                layout,
                WEIGHTS[group],
                UplinkEncoder("none", 64),
            )
    finally:
        link.close()
    withdrawn = p.status()[group][1]["rejected"]
    assert withdrawn and "withdrew" in withdrawn, withdrawn


@pytest.mark.parametrize(
    "how", ["refused", "refused after the other ended", "cut short", "weight over the bound"]
)
def test_a_group_the_commit_will_refuse_is_not_waited_for_and_the_fold_is_kept(pool, how):
    """Group 2 sends NaN to one aggregator (the rank then withdraws its stream to the other,
    or, where that stream had ended already, the upload it made) before the others are done,
    or ends its streams without the end mark (a rank that died),
    or declares a weight above the ServerApp's bound (it cannot
    be accepted) after them: both aggregators stop waiting for it, the followers get the mean
    of groups 0 and 1 before the commit, bit for bit what the commit of those two makes, and
    every aggregator keeps the fold."""
    p, layout = pool(count=2)
    q, _ = pool(count=2)
    for x in (p, q):
        x.begin(1)
    p.expect(1, list(WEIGHTS), max_weight=10_000.0)
    followers = [f for fs in follow_all(p, layout, 1, -1).values() for f in fs]
    deltas = updates(11)
    for g in (0, 1):
        if how == "refused" and g == 1:  # between the two honest groups' uploads
            refused_upload(p, layout, 1, 2, deltas[2])
        if how == "refused after the other ended" and g == 1:
            refused_late_upload(p, layout, 1, 2, deltas[2])
        if how == "cut short" and g == 1:
            cut_short_upload(p, layout, 1, 2, deltas[2])
        for x in (p, q):
            upload_group(x, layout, 1, g, deltas[g], KS[g], WEIGHTS[g])
    if how == "weight over the bound":  # after the others: only then are they all folded
        upload_group(p, layout, 1, 2, deltas[2], KS[2], 10_001.0)
    for f in followers:
        assert not f.wait().thread.is_alive() and f.error is None, f.error
    accepted = {0: WEIGHTS[0], 1: WEIGHTS[1]}
    q.commit(1, accepted)
    assert p.commit(1, accepted)  # every aggregator kept the fold
    q.begin(2)
    _, ref = download_all(q, layout, 2, 0)
    for g in (0, 1, 2):  # group 2's ranks followed too: they hold the same model
        held = assemble([f for f in followers if f.group == g], layout)
        for n in SHAPES:
            np.testing.assert_array_equal(held[n], ref[n])


@pytest.mark.parametrize("failure", ["rejected after a fold", "silent", "screened out"])
def test_a_group_left_out_voids_what_was_followed_and_the_commit_is_the_mean_of_the_others(
    pool, failure
):
    """A group the aggregator rejects once a parameter was folded with it ends the
    followers' streams at once; one that never sends, or that the ServerApp leaves out after
    it sent, ends them at the commit. Either way they pull a full snapshot, the mean of the
    groups the commit accepted."""
    p, layout = pool(count=2)
    q, _ = pool(count=2)
    for x in (p, q):
        x.begin(1)
    p.expect(1, list(WEIGHTS))
    followers = [f for fs in follow_all(p, layout, 1, -1, groups=(0, 1)).values() for f in fs]
    deltas = updates(7)
    if failure == "rejected after a fold":
        for g in (0, 1):  # the others send everything, group 2 one parameter: it is folded
            upload_group(p, layout, 1, g, deltas[g], KS[g], WEIGHTS[g])
        c = next(q for q in layout.params if q.name == "c.bias")
        link = RankLink(ticket(p, 1, 2), 0)
        try:
            piece = [(c.index, 0, deltas[2][c.name])]
            link.upload(piece, layout, WEIGHTS[2], UplinkEncoder("none", 64))
        finally:
            link.close()
        nan = wire.encode_chunk(c.index, 0, np.array([1, np.nan], np.float32), "none", 64)
        assert not bad_upload(p, 1, 2, nan, c.owner)["ok"]
        for f in followers:  # voided before the others' uploads reached the reference
            assert not f.wait(30).thread.is_alive() and "ABORTED" in f.error, f.error
    accepted = {0: WEIGHTS[0], 1: WEIGHTS[1]}
    for g in (0, 1) if failure != "screened out" else (0, 1, 2):
        for x in (p, q) if failure != "rejected after a fold" else (q,):
            upload_group(x, layout, 1, g, deltas[g], KS[g], WEIGHTS[g])
    if failure == "silent":
        time.sleep(1.0)
        assert all(f.thread.is_alive() for f in followers)  # waiting for group 2
    q.commit(1, accepted)
    assert not p.commit(1, accepted)  # no aggregator kept it
    for f in followers:
        assert not f.wait(30).thread.is_alive()
        if failure != "screened out":  # it may have had all before the commit: then void there
            assert "ABORTED" in f.error, f.error
    for x in (p, q):
        x.begin(2)
    assert pull_mode(p, layout, 2, 1)[0] == "full"  # what they followed is void
    _, ref = download_all(q, layout, 2, 0)
    _, got = download_all(p, layout, 2, 0)
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], ref[n])
