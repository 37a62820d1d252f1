"""The flower transport's compressed downlink, server and group side, as pure code.

The server (:class:`~flower_shard.flower.server.downlink.Downlink`) and a group
(:class:`~flower_shard.flower.group.exchange.FlowerExchange`) must hold the very same model
after every round, bit for bit, whether the group got the deltas or a snapshot; the held model
must follow the server's global model with the compression's error fed back (the distance
stays bounded, it does not grow round after round); a group that missed a round refuses the
next delta before it trains and gets a snapshot. With one honest group and fedavg, the flower
transport's new global weights are exactly that group's trained weights, as without compression.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord

from flower_shard import protocol as P
from flower_shard.config import TrainConfig
from flower_shard.flower.group.exchange import FlowerExchange
from flower_shard.flower.server.downlink import Downlink
from flower_shard.flower.wire import describe, pack

SHAPES = {"b": (37,), "a": (8, 16)}  # not in sorted order: the wire order is by name
CHUNK = 16


def model(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def arrays_of(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def group(kind: str) -> FlowerExchange:
    return FlowerExchange(TrainConfig(compression_chunk=CHUNK), rank=0)


def shapes() -> dict:
    return {k: (s, "") for k, s in SHAPES.items()}


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_the_group_holds_exactly_what_the_server_sent_and_follows_the_global_model(kind):
    server_global = model(0)
    down = Downlink(kind, CHUNK, server_global)
    g = group(kind)
    distances = []
    for rnd in range(1, 7):
        server_global = {k: v + model(rnd, 0.01)[k] for k, v in server_global.items()}
        down.advance(server_global)
        record, keys = down.records(node=7)
        got = g.receive(arrays_of(record), keys, shapes())
        assert (P.DOWNLINK in keys) == (rnd > 1)  # a snapshot first, then deltas
        assert np.array_equal(pack(got), down.sent.numpy())  # bit for bit
        down.acknowledge([7])
        distances.append(float(np.abs(pack(server_global) - down.sent.numpy()).max()))
    # Error feedback by construction: what a round loses goes out later; it does not pile up.
    assert max(distances[1:]) <= 2 * max(distances[1], 1e-12)
    assert distances[-1] < 0.01 * np.abs(pack(server_global)).max()


def test_a_group_that_missed_a_round_refuses_the_delta_and_gets_a_snapshot():
    down = Downlink("int8", CHUNK, model(0))
    g = group("int8")
    down.advance(model(1))
    g.receive(arrays_of(down.records(1)[0]), down.records(1)[1], shapes())
    down.acknowledge([1])
    down.advance(model(2))
    down.acknowledge([])  # node 1's reply of round 2 failed: it may hold either version
    down.advance(model(3))
    record, keys = down.records(1)
    assert P.DOWNLINK not in keys and list(arrays_of(record)) == [P.PACKED]
    # Had it been sent the delta from version 2, the group (at version 1) refuses it, in one
    # line that says what happens next.
    delta_keys = {P.DOWNLINK: "int8", P.DOWNLINK_BASE: 2, P.DOWNLINK_VERSION: 3}
    assert "holds 1; the server sends a snapshot next round" in g.refusal(delta_keys)
    got = g.receive(arrays_of(record), keys, shapes())
    assert np.array_equal(pack(got), down.sent.numpy()) and g.held_version == 3


def test_a_resumed_server_sends_the_same_model_it_had():
    down = Downlink("bf16", CHUNK, model(0))
    for rnd in (1, 2):
        down.advance(model(rnd))
        down.acknowledge([1])
    state = down.state_dict()
    again = Downlink("bf16", CHUNK, model(0))
    again.load_state_dict(state)
    down.advance(model(3))
    again.advance(model(3))
    assert np.array_equal(down.sent.numpy(), again.sent.numpy())
    assert P.DOWNLINK in down.records(1)[1] and P.DOWNLINK not in again.records(1)[1]


def test_one_group_with_fedavg_gives_its_trained_weights_exactly():
    """The flower transport with downlink int8 (uncompressed replies): the group trains from
    the held model; with fedavg and one group the next global model is its trained model."""
    from flower_shard.config.federation import FederationConfig
    from flower_shard.flower.server.transports import FlowerTransport

    fed = FederationConfig.from_run_config(
        {"downlink-compression": "int8", "compression-chunk": CHUNK, "outlier-factor": 0}
    )
    start = model(0)
    transport = FlowerTransport(fed, start)
    transport.begin_round(1)
    held = transport.reference()
    assert describe(held) == describe(dict(sorted(start.items())))
    trained = {k: v + model(5, 0.01)[k] for k, v in held.items()}
    from test_robust_aggregation import play, reply

    assert play(transport, [reply(1, trained, 2 * 8 * 4 * 2)]) == []
    for k in trained:
        assert np.array_equal(transport.global_arrays[k], trained[k]), k
