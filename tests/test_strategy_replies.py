"""Reply checks, fed real Flower Messages: every value the server reads, every way it can be bad.

Each test builds the instruction a node would get (a real ``flwr.app.Message``) and the node's
reply to it (``Message(content, reply_to=...)``, as a ClientApp makes it), then runs the one
check the strategy runs (:mod:`flower_shard.flower.server.replies`) or the transport's own
selection of it. A bad value must be refused with a reason that names it, and a bad reply
among good ones must reject that reply only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import instruction
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.server.superlink.linkstate.utils import (
    NODE_UNAVAILABLE_ERROR_REASON,
    create_message_error_unavailable_res_message,
)

from flower_shard import protocol as P
from flower_shard.config.federation import FederationConfig
from flower_shard.errors import ConfigError
from flower_shard.flower.server import payloads as D
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.transports import (
    TRANSPORTS,
    CollectiveTransport,
    FlowerTransport,
    transport_class,
)
from flower_shard.flower.wire import describe, pack
from flower_shard.runtime import compression as Z

NODES = {11: 0, 12: 1}  # node id -> the group index its message carried
ASKED = {f"ins-{node}": node for node in NODES}  # message id -> the node it went to
RULES = R.ReplyRules(
    asked=ASKED, groups=NODES, max_steps=4, tokens_per_step=64, max_lr=3e-3, max_seconds=1200.0
)
FIELDS = R.TRAIN_FIELDS + R.SYNC_FIELDS


def reply(node: int, metrics: dict, record=MetricRecord, **records) -> Message:
    """``node``'s reply: its metrics in a ``record`` (ConfigRecord carries strings and bools)."""
    content = RecordDict({P.METRICS: record(metrics), **records})
    return Message(content, reply_to=instruction(node))


def good_metrics(node: int = 11) -> dict:
    """What a group of 2 ranks replies after 4 steps (its train call, then its ClientApp)."""
    return {
        P.GROUP: NODES[node],
        P.STEPS: 4,
        P.NUM_TOKENS: 4 * 64 * 2,
        P.TRAIN_LOSS: 5.25,
        P.LR: 1.5e-3,
        P.COMPUTE_S: 0.75,
        P.INTRA_COMM_S: 0.25,
        P.INTRA_BYTES: 4096.0,
        P.GROUP_ROUND_S: 1.0,
        P.CLIENTAPP_PID: 4242,
        P.OUTER_SYNC_S: 0.125,
        P.OUTER_SYNC_BYTES: 2048,
        P.STEP: 40,  # not read by the server: never checked, never refused
    }


def test_a_good_reply_gives_every_value_typed_and_exact():
    checked = R.check_train_reply(reply(12, good_metrics(12)), RULES, FIELDS)
    assert checked == R.TrainReply(
        node=12,
        group=1,
        steps=4,
        num_tokens=512,
        train_loss=5.25,
        lr=1.5e-3,
        compute_s=0.75,
        intra_comm_s=0.25,
        intra_bytes=4096.0,
        group_round_s=1.0,
        clientapp_pid=4242,
        ranks=2,
        outer_sync_s=0.125,
        outer_sync_bytes=2048,
    )
    # The ClientApp's pid is optional; the other fields are not.
    del_pid = {k: v for k, v in good_metrics().items() if k != P.CLIENTAPP_PID}
    assert R.check_train_reply(reply(11, del_pid), RULES, FIELDS).clientapp_pid == 0


BAD_VALUES = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "list": [1.0, 2.0],
    "string": "12",
    "bool": True,
    "negative": -1,
    "absurd": 10**30,
}
# The server's checks by field: every value above is refused for every field it reads.
CASES = [(f.key, kind) for f in FIELDS for kind in BAD_VALUES]


@pytest.mark.parametrize(("key", "kind"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_each_bad_value_of_each_metric_is_refused_by_name(key, kind):
    metrics = good_metrics() | {key: BAD_VALUES[kind]}
    # MetricRecord refuses strings and bools itself; a ConfigRecord carries them to the server.
    record = ConfigRecord if kind in ("string", "bool") else MetricRecord
    with pytest.raises(R.Rejected, match=repr(key)):
        R.check_train_reply(reply(11, metrics, record), RULES, FIELDS)
    # Among good replies, only the bad one goes, with its node and reason.
    ok, rejected = R.check_train_replies(
        3, [reply(11, metrics, record), reply(12, good_metrics(12))], RULES, FIELDS
    )
    assert [r.node for r in ok] == [12]
    assert len(rejected) == 1 and rejected[0].startswith("node 11: ") and key in rejected[0]


@pytest.mark.parametrize("field", [f for f in FIELDS if f.required], ids=lambda f: f.key)
def test_a_missing_required_metric_is_refused(field):
    metrics = {k: v for k, v in good_metrics().items() if k != field.key}
    with pytest.raises(R.Rejected, match=f"metric {field.key!r} missing"):
        R.check_train_reply(reply(11, metrics), RULES, FIELDS)


def test_ranges_come_from_what_the_server_sent():
    def refused(**changes) -> str:
        with pytest.raises(R.Rejected) as caught:
            R.check_train_reply(reply(11, good_metrics() | changes), RULES, FIELDS)
        return str(caught.value)

    assert "outside [1, 4]" in refused(**{P.STEPS: 5})  # more steps than the round's T
    assert "outside [0, 0.003" in refused(**{P.LR: 3.1e-3})  # above the configured peak LR
    assert P.NUM_TOKENS in refused(**{P.NUM_TOKENS: 0})
    assert P.NUM_TOKENS in refused(**{P.NUM_TOKENS: 4 * 64 * (1 << 16) + 1})
    assert P.COMPUTE_S in refused(**{P.COMPUTE_S: 1200.5})  # longer than the server waited
    assert "sent group 0" in refused(**{P.GROUP: 1})  # another group's index
    assert P.STEPS in refused(**{P.STEPS: 2.0})  # a count must be an int
    # Bounds are inclusive.
    edge = {P.STEPS: 4, P.LR: 3e-3, P.COMPUTE_S: 1200.0, P.TRAIN_LOSS: 0.0}
    assert R.check_train_reply(reply(11, good_metrics() | edge), RULES, FIELDS).steps == 4


def test_malformed_replies_are_refused_and_none_escapes_the_round():
    content = RecordDict({P.METRICS: MetricRecord(good_metrics())})
    stranger = Message(content, reply_to=instruction(99))
    error = Message(Error(code=2, reason="group failed: boom"), reply_to=instruction(11))
    no_metrics = Message(RecordDict({}), reply_to=instruction(11))
    wrong_record = Message(
        RecordDict({P.METRICS: ArrayRecord({"x": Array(np.zeros(1, np.float32))})}),
        reply_to=instruction(11),
    )
    # The SuperLink's own error reply for a node it lost: from node 1, about node 11's message.
    lost = create_message_error_unavailable_res_message(instruction(11).metadata, "node")
    assert lost.metadata.src_node_id == 1
    impostor = Message(content, reply_to=instruction(11))
    impostor.metadata.__dict__["_src_node_id"] = 12
    for bad, why in (
        (stranger, "node 99: a reply to no message of this round"),
        (lost, "node 11: error reply: " + NODE_UNAVAILABLE_ERROR_REASON),
        (impostor, "node 11: a reply from node 12 to node 11's message"),
        (error, "error reply: group failed: boom"),
        (no_metrics, "no 'metrics' record"),
        (wrong_record, "'metrics' is a ArrayRecord"),
        (None, "unreadable reply (AttributeError"),  # not even a Message
    ):
        ok, rejected = R.check_train_replies(1, [bad, reply(12, good_metrics(12))], RULES, FIELDS)
        assert [r.node for r in ok] == [12]
        assert len(rejected) == 1 and why in rejected[0], rejected


def test_evaluation_replies_are_checked_the_same_way():
    def ev(node, value, record=MetricRecord, **extra):
        return Message(
            RecordDict({P.METRICS: record({P.EVAL_LOSS: value} | extra)}),
            reply_to=instruction(node, MessageType.EVALUATE),
        )

    asked = {f"ins-{n}": n for n in range(11, 22)}
    pull = P.EVAL_PULL_S
    checked, rejected = R.check_eval_replies(
        2,
        [
            ev(11, 3.5),
            ev(12, math.nan),
            ev(13, "3.5", ConfigRecord),
            ev(14, -0.5),
            ev(15, 1e300),
            Message(Error(code=2, reason="no group"), reply_to=instruction(16)),
            ev(17, 3.25, **{pull: 2.5}),  # streaming: the seconds its download took
            ev(18, 3.5, **{pull: -1.0}),
            ev(19, 3.5, **{pull: math.inf}),
            ev(20, 3.5, **{pull: 1e30}),
            ev(21, 3.5, ConfigRecord, **{pull: "2.5"}),
        ],
        asked,
    )
    assert checked == [(3.5, 0.0), (3.25, 2.5)]
    bad = (12, 13, 14, 15, 16, 18, 19, 20, 21)
    assert [line.split(":")[0] for line in rejected] == [f"node {n}" for n in bad]
    assert all(": evaluate: " in line for line in rejected)
    assert all(pull in line for line in rejected[-4:])


# -- arrays -------------------------------------------------------------------------------------


def model(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full((2, 3), value, np.float32), "b": np.full(4, -value, np.float32)}


def test_check_arrays_names_each_problem():
    expected = describe(model(0.0))
    assert D.check_arrays(model(1.0), expected) is None
    bad = model(1.0)
    bad["a"][0, 0] = np.inf
    assert "non-finite" in D.check_arrays(bad, expected)
    assert "missing" in D.check_arrays({"a": model(1.0)["a"]}, expected)
    extra = model(1.0) | {"c": np.zeros(1, np.float32)}
    assert "unexpected" in D.check_arrays(extra, expected)
    assert "shape" in D.check_arrays(model(1.0) | {"b": np.zeros(5, np.float32)}, expected)
    assert "dtype" in D.check_arrays(model(1.0) | {"b": np.zeros(4, np.float64)}, expected)


def fed(**run_config) -> FederationConfig:
    return FederationConfig.from_run_config({"min-groups": 1} | run_config)


def arrays_reply(record) -> RecordDict:
    return RecordDict({P.METRICS: MetricRecord(good_metrics()), P.ARRAYS: record})


def test_flower_transport_refuses_malformed_weights():
    transport = FlowerTransport(fed(), model(0.0))
    good = pack(model(2.0))
    payload = transport.check_payload(arrays_reply(ArrayRecord({P.PACKED: Array(good)})))
    assert all(np.array_equal(payload.arrays[k], model(2.0)[k]) for k in "ab")
    assert payload.nbytes > good.nbytes
    nan = good.copy()
    nan[3] = np.nan
    garbage = Array(dtype="float32", shape=(10,), stype="numpy.ndarray", data=b"not an npy")
    for record, why in (
        (ArrayRecord({P.PACKED: Array(nan)}), "non-finite"),
        (ArrayRecord({P.PACKED: Array(good[:-1])}), "wrong shape"),
        (ArrayRecord({P.PACKED: Array(good.astype(np.float64))}), "dtype float64"),
        (ArrayRecord({P.PACKED: Array(good.reshape(2, 5))}), "wrong shape"),
        (ArrayRecord({P.PACKED: Array(good), "x": Array(good)}), "unexpected arrays"),
        (ArrayRecord({"a": Array(model(1.0)["a"])}), "missing arrays"),
        (ArrayRecord({P.PACKED: garbage}), "undecodable arrays"),
        (MetricRecord({P.PACKED: 1.0}), "not an ArrayRecord"),
    ):
        with pytest.raises(R.Rejected, match=why):
            transport.check_payload(arrays_reply(record))
    with pytest.raises(R.Rejected, match="no 'arrays' record"):
        transport.check_payload(RecordDict({P.METRICS: MetricRecord(good_metrics())}))


def test_flower_transport_refuses_compressed_updates_that_decode_to_inf():
    import torch

    transport = FlowerTransport(fed(compression="int8", **{"compression-chunk": 4}), model(0.0))
    delta = torch.linspace(-1, 1, 10)
    payload = {k: v.numpy() for k, v in Z.compress(delta, "int8", 4).items()}
    record = ArrayRecord({k: Array(v) for k, v in payload.items()})
    decoded = transport.check_payload(arrays_reply(record)).arrays[D.DELTA]
    assert np.array_equal(decoded, Z.decompress(Z.compress(delta, "int8", 4), "int8", 4).numpy())
    # Finite scales that overflow float32 once multiplied by the int8 values.
    huge = dict(payload, **{Z.SCALES: np.full_like(payload[Z.SCALES], 3e38)})
    with pytest.raises(R.Rejected, match="non-finite"):
        transport.check_payload(arrays_reply(ArrayRecord({k: Array(v) for k, v in huge.items()})))
    text = dict(payload, **{Z.SCALES: np.array(["x"] * payload[Z.SCALES].size)})
    with pytest.raises(R.Rejected, match="non-numeric"):
        transport.check_payload(arrays_reply(ArrayRecord({k: Array(v) for k, v in text.items()})))


def test_every_transport_is_registered_under_its_protocol_name():
    assert {P.FLOWER, P.COLLECTIVE} <= set(TRANSPORTS) <= set(P.TRANSPORTS)
    assert all(cls.name == name for name, cls in TRANSPORTS.items())
    assert transport_class(P.COLLECTIVE) is CollectiveTransport
    with pytest.raises(ConfigError, match="'pigeon' has no server side here"):
        transport_class("pigeon")
    # The collective transport's replies carry the groups' own sync figures; the flower one's
    # arrays, which the server measures itself.
    assert CollectiveTransport.reply_fields == R.SYNC_FIELDS
    assert FlowerTransport.reply_fields == ()
