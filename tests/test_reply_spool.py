"""The flower transport's replies taken one at a time as they arrive (issue 14, item 5).

Each valid reply is checked, its arrays written to the transport's spool and dropped from the
message (:class:`~flower_shard.flower.server.replies.Intake` with the transport's ``keep``);
the aggregation reads the spool in group order. These tests drive the real checks, the real
transport and real Flower Messages (built as a node builds them) and compare the new global
model bit for bit with the token-weighted mean computed here on the arrays as sent.
"""

from __future__ import annotations

import itertools
import os
import stat

import numpy as np
import pytest
from test_robust_aggregation import (
    HONEST,
    fed,
    honest_delta,
    mean_of,
    reply,
    rules,
    start,
    trained,
)

from flower_shard import protocol as P
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.aggregation import FOLD_CHUNK, weighted_mean
from flower_shard.flower.server.transports import FlowerTransport


def one_round(transport: FlowerTransport, messages: list, order: list[int]) -> list:
    """The strategy's round on the replies in ``order`` of arrival: take each, screen the
    valid ones in group order, aggregate. Returns what the intake kept of each message."""
    intake = R.Intake(
        1, rules(len(messages)), R.TRAIN_FIELDS, transport.check_payload, transport.keep
    )
    kept = [intake.take(messages[i]) for i in order]
    ok = sorted(intake.ok, key=lambda r: r.group)
    out = transport.screen(ok)
    transport.aggregate(1, [r for i, r in enumerate(ok) if i not in out], commit=True)
    return kept


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_new_model_is_the_same_bits_whatever_order_the_replies_arrive_in(order):
    g = start()
    models = [trained(g, honest_delta(i), times=1 + i) for i in range(3)]
    tokens = [HONEST, 2 * HONEST, 3 * HONEST]
    with FlowerTransport(fed(), g) as transport:
        messages = [reply(i + 1, m, t) for i, (m, t) in enumerate(zip(models, tokens))]
        kept = one_round(transport, messages, list(order))
        got = transport.global_arrays
    want = mean_of(models, tokens)  # in group order, float64 sums
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    # Nothing of a reply's size stays in the messages the round keeps.
    assert all(P.ARRAYS not in m.content for m in kept)


def test_spooled_replies_live_in_a_private_directory_that_goes_with_the_transport():
    g = start()
    transport = FlowerTransport(fed(), g)
    with transport:
        directory = transport.spool.directory
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        intake = R.Intake(1, rules(2), R.TRAIN_FIELDS, transport.check_payload, transport.keep)
        intake.take(reply(1, trained(g, honest_delta(0)), HONEST))
        bad = trained(g, honest_delta(1))
        bad["a"][0, 0] = np.nan
        intake.take(reply(2, bad, HONEST))
        # Only the valid reply was written; the NaN one was rejected before.
        assert [p.name for p in directory.iterdir()] == ["node-1"]
        assert len(intake.rejected) == 1 and "non-finite" in intake.rejected[0]
        transport.aggregate(1, intake.ok, commit=True)
        assert list(directory.iterdir()) == []  # emptied once the round is aggregated
    assert not directory.exists()


def test_a_reply_kept_without_an_opened_transport_is_rejected_not_lost():
    """keep() before open() is a bug of the caller: the reply is refused with the reason, the
    others go on."""
    g = start()
    transport = FlowerTransport(fed(), g)
    intake = R.Intake(1, rules(1), R.TRAIN_FIELDS, transport.check_payload, transport.keep)
    intake.take(reply(1, trained(g, honest_delta(0)), HONEST))
    assert intake.ok == [] and "before open()" in intake.rejected[0]


def test_the_fold_is_exact_across_its_slices():
    """Arrays longer than the fold's slice: each coordinate is still sum w x / sum w in float64
    rounded once to float32."""
    rng = np.random.default_rng(3)
    n = FOLD_CHUNK + 12345
    models = [{"x": rng.normal(size=n).astype(np.float32)} for _ in range(3)]
    weights = [3, 5, 7]
    want = sum(w * m["x"].astype(np.float64) for m, w in zip(models, weights)) / 15
    assert np.array_equal(weighted_mean(models, weights)["x"], want.astype(np.float32))
