"""ShardedFedAvg's round loop on a real Flower Grid, with the groups' replies written here.

The Grid is Flower's own ``InMemoryGrid`` over an in-memory LinkState (what ``flwr run`` on a
simulation federation uses); each node is a thread that takes its messages from the LinkState
and stores its reply there, as Flower's simulation engine does for a ClientApp. The replies are
the test's: a group's exact metrics and weights, or one bad value, or none at all, so the
round's record can be checked exactly. The groups' real processes are tested in test_flower.py.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import pytest
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
from flwr.common.constant import (
    HEARTBEAT_INTERVAL_INF,
    NOOP_ACCOUNT_NAME,
    NOOP_FLWR_AID,
    SUPERLINK_NODE_ID,
)
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.utils import NODE_UNAVAILABLE_ERROR_REASON
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from flower_shard import protocol as P
from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server.strategy import ShardedFedAvg
from flower_shard.flower.wire import pack
from flower_shard.launch.processes import free_port

BATCH, SEQ, RANKS = 2, 32, 2
Answer = Callable[[int, Message], Message | None]


@contextmanager
def live_grid(num_nodes: int, answer: Answer):
    """An InMemoryGrid with ``num_nodes`` nodes; ``answer(node, message)`` gives each node's
    reply (None: the node stays silent). Yields the Grid; stops the nodes on exit."""
    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    state = factory.state()
    run_id = state.create_run(
        None, None, None, {}, NOOP_FEDERATION_ID, None, None, TaskType.SERVER_APP
    )
    run = state.get_run_info(run_ids=[run_id])[0]
    nodes = []
    for _ in range(num_nodes):
        node = state.create_node(
            NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32), HEARTBEAT_INTERVAL_INF
        )
        state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=HEARTBEAT_INTERVAL_INF)
        nodes.append(node)
    stop = threading.Event()
    failed: list[BaseException] = []

    def serve(node: int) -> None:
        try:
            while not stop.is_set():
                for msg in state.get_message_ins(node_id=node, limit=None):
                    out = answer(node, msg)
                    if out is not None:
                        out.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as the engine
                        state.store_message_res(out)
                time.sleep(0.005)
        except BaseException as exc:  # the test's own mistake: fail the test with it
            failed.append(exc)

    # This process acts as the ServerApp's: Messages take their run and node from here.
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id = run.primary_task_id, run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    threads = [threading.Thread(target=serve, args=(n,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    try:
        grid = InMemoryGrid(factory)
        grid.set_run(run)
        yield grid
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
    if failed:
        raise failed[0]


def federation(**run_config) -> FederationConfig:
    return FederationConfig.from_run_config(
        {
            P.MIN_GROUPS: 1,
            P.LOCAL_STEPS: 2,
            P.POLL_INTERVAL: 0.01,
            P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
            "batch-size": BATCH,
            "seq-len": SEQ,
            "lr": 3e-3,
        }
        | run_config
    )


def initial() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}


def group_metrics(msg: Message, **over) -> dict:
    """What a group of RANKS ranks replies to a training message, as its service measures it."""
    cfg = msg.content[P.CONFIG]
    steps = int(cfg[P.ROUND_STEPS])
    return {
        P.GROUP: int(cfg[P.GROUP_INDEX]),
        P.STEPS: steps,
        P.NUM_TOKENS: steps * BATCH * SEQ * RANKS,
        P.TRAIN_LOSS: 4.0 + int(cfg[P.GROUP_INDEX]),
        P.LR: 1e-3,
        P.COMPUTE_S: 0.01,
        P.INTRA_COMM_S: 0.001,
        P.INTRA_BYTES: 1000.0,
        P.GROUP_ROUND_S: 0.02,
        P.CLIENTAPP_PID: 1000 + int(cfg[P.GROUP_INDEX]),
    } | over


def metrics_reply(msg: Message, metrics: dict, record=MetricRecord, **records) -> Message:
    return Message(RecordDict({P.METRICS: record(metrics), **records}), reply_to=msg)


def test_reply_wait_is_the_training_exchange_not_the_evaluations():
    """Groups that hold the model (collective): the training replies come after TRAIN_S, the
    evaluation's at once. reply_wait_s is the wait for the training replies in every round;
    the evaluation's own exchange, later in the round, does not replace it."""
    train_s = 0.6
    weights = {k: v + 1 for k, v in initial().items()}

    def group(node: int, msg: Message) -> Message:
        kind = msg.metadata.message_type
        if kind == MessageType.TRAIN:
            time.sleep(train_s)
            sync = {P.OUTER_SYNC_S: 0.003, P.OUTER_SYNC_BYTES: 500}
            return metrics_reply(msg, group_metrics(msg, **sync))
        if kind == MessageType.EVALUATE:
            return metrics_reply(msg, {P.EVAL_LOSS: 2.5})
        return Message(  # QUERY: the model the groups hold
            RecordDict({P.ARRAYS: ArrayRecord({k: Array(v) for k, v in weights.items()})}),
            reply_to=msg,
        )

    fed = federation(transport=P.COLLECTIVE, **{P.NUM_SERVER_ROUNDS: 2, "eval-every": 1})
    strategy = ShardedFedAvg(fed)
    with live_grid(2, group) as grid:
        arrays = ArrayRecord({k: Array(v) for k, v in initial().items()})
        result = strategy.start(grid, arrays, num_rounds=2, timeout=30)
    rounds = strategy.history
    assert [r[P.ROUND] for r in rounds] == [1, 2]
    for r in rounds:
        assert r[P.GROUPS_OK] == 2 and r[P.REJECTED] == []
        assert r[P.EVAL_LOSS] == 2.5
        assert r[P.REPLY_WAIT_S] >= train_s, r  # old code: the evaluation's wait, ~0.05 s
        assert r[P.EVAL_S] < train_s
        assert r[P.PUSH_S] + r[P.REPLY_WAIT_S] + r[P.EVAL_S] <= r[P.ROUND_S]
        assert r[P.OUTER_SYNC_S] == 0.003 and r[P.OUTER_SYNC_BYTES] == 500
        assert r[P.EXCHANGE_BYTES] == 0  # configs only
    assert rounds[-1][P.TOKENS] == 2 * 2 * (2 * BATCH * SEQ * RANKS)
    final = {k: v.numpy() for k, v in result.arrays.items()}
    assert sorted(final) == sorted(weights)
    assert all(np.array_equal(final[k], weights[k]) for k in weights)


BAD_ROUNDS = {  # round -> (what node B sends, what the rejection must name)
    1: ({P.NUM_TOKENS: float("nan")}, P.NUM_TOKENS),
    2: ({P.TRAIN_LOSS: "low"}, P.TRAIN_LOSS),
    3: ({P.STEPS: 10**30}, P.STEPS),
    4: ({P.COMPUTE_S: -1.0}, P.COMPUTE_S),
    5: ({P.GROUP: True}, P.GROUP),
    6: ("garbage arrays", "undecodable arrays"),
    7: ("error", "error reply: group failed: boom"),
}


def test_bad_replies_are_rejected_and_each_round_goes_on_with_the_others():
    """Flower transport, three nodes: A replies well, B badly (another way each round), C
    never. Each round takes A's weights exactly and names B's and C's problem."""
    sent = {}  # round -> A's weights

    def group(node: int, msg: Message) -> Message | None:
        cfg = msg.content[P.CONFIG]
        rnd, index = int(cfg[P.SERVER_ROUND]), int(cfg[P.GROUP_INDEX])
        start = {k: v.numpy() for k, v in msg.content[P.ARRAYS].items()}[P.PACKED]
        if index == 2:
            return None
        packed = start + np.float32(rnd)
        arrays = {P.ARRAYS: ArrayRecord({P.PACKED: Array(packed)})}
        if index == 0:
            sent[rnd] = packed
            return metrics_reply(msg, group_metrics(msg), **arrays)
        bad, _ = BAD_ROUNDS[rnd]
        if bad == "error":
            return Message(Error(code=2, reason="group failed: boom"), reply_to=msg)
        if bad == "garbage arrays":
            junk = Array(dtype="float32", shape=(10,), stype="numpy.ndarray", data=b"junk")
            return metrics_reply(msg, group_metrics(msg), arrays=ArrayRecord({P.PACKED: junk}))
        strings = any(isinstance(v, (str, bool)) for v in bad.values())
        record = ConfigRecord if strings else MetricRecord  # MetricRecord refuses them
        return metrics_reply(msg, group_metrics(msg, **bad), record, **arrays)

    n = len(BAD_ROUNDS)
    fed = federation(**{P.NUM_SERVER_ROUNDS: n, P.LOCAL_STEPS: 1, P.ROUND_TIMEOUT: 1.0})
    strategy = ShardedFedAvg(fed)
    evaluated = []

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(pack({k: v.numpy() for k, v in arrays.items()}))
        return MetricRecord({P.EVAL_LOSS: 1.0 / rnd})

    with live_grid(3, group) as grid:
        arrays = ArrayRecord({k: Array(v) for k, v in initial().items()})
        result = strategy.start(grid, arrays, num_rounds=n, timeout=30, evaluate_fn=evaluate)
    rounds = strategy.history
    assert [r[P.ROUND] for r in rounds] == list(range(1, n + 1))
    for r in rounds:
        _, named = BAD_ROUNDS[r[P.ROUND]]
        assert r[P.GROUPS_OK] == 1 and r[P.GROUPS_REJECTED] == 2, r
        reasons = " | ".join(r[P.REJECTED])
        assert named in reasons and "no reply within round-timeout" in reasons, reasons
        assert r[P.TRAIN_LOSS] == 4.0 and r[P.GROUPS][0][P.GROUP] == 0  # A's alone
        assert r[P.TOKENS] == r[P.ROUND] * BATCH * SEQ * RANKS
    # Every round's global model is exactly A's reply (the mean of one group, fedavg).
    for rnd in range(1, n + 1):
        assert np.array_equal(evaluated[rnd - 1], sent[rnd]), rnd
    final = pack({k: v.numpy() for k, v in result.arrays.items()})
    assert np.array_equal(final, sent[n])


def test_fewer_valid_replies_than_min_groups_keep_the_model():
    def group(node: int, msg: Message) -> Message:
        cfg = msg.content[P.CONFIG]
        packed = {k: v.numpy() for k, v in msg.content[P.ARRAYS].items()}[P.PACKED]
        bad = {P.LR: 1.0} if int(cfg[P.GROUP_INDEX]) == 1 else {}  # above the peak LR
        arrays = ArrayRecord({P.PACKED: Array(packed + 1)})
        return metrics_reply(msg, group_metrics(msg, **bad), arrays=arrays)

    fed = federation(**{P.NUM_SERVER_ROUNDS: 1, P.MIN_GROUPS: 2})
    strategy = ShardedFedAvg(fed)
    with live_grid(2, group) as grid:
        arrays = ArrayRecord({k: Array(v) for k, v in initial().items()})
        result = strategy.start(grid, arrays, num_rounds=1, timeout=30)
    (r,) = strategy.history
    assert r[P.GROUPS_OK] == 1 and "'lr'" in r[P.REJECTED][0]
    assert 1 not in result.train_metrics_clientapp
    final = {k: v.numpy() for k, v in result.arrays.items()}
    assert all(np.array_equal(final[k], initial()[k]) for k in final)


def test_a_node_the_superlink_loses_is_one_rejection_in_its_own_name():
    """The SuperLink answers for a node it lost (an error reply from node 1, about that node's
    message): the round counts it once, under the lost node's id."""
    lost: list[int] = []
    grids: list[InMemoryGrid] = []

    def group(node: int, msg: Message) -> Message | None:
        if int(msg.content[P.CONFIG][P.GROUP_INDEX]) == 1:
            lost.append(node)
            grids[0].state.deactivate_node(node)  # gone without a word
            return None
        packed = {k: v.numpy() for k, v in msg.content[P.ARRAYS].items()}[P.PACKED]
        arrays = ArrayRecord({P.PACKED: Array(packed)})
        return metrics_reply(msg, group_metrics(msg), arrays=arrays)

    strategy = ShardedFedAvg(federation(**{P.NUM_SERVER_ROUNDS: 1}))
    with live_grid(2, group) as grid:
        grids.append(grid)
        arrays = ArrayRecord({k: Array(v) for k, v in initial().items()})
        strategy.start(grid, arrays, num_rounds=1, timeout=30)
    (r,) = strategy.history
    assert r[P.GROUPS_OK] == 1 and r[P.GROUPS_REJECTED] == 1
    assert r[P.REJECTED] == [f"node {lost[0]}: error reply: {NODE_UNAVAILABLE_ERROR_REASON}"]


@pytest.mark.parametrize("transport", [P.FLOWER, P.COLLECTIVE])
def test_messages_carry_what_the_transport_needs(transport):
    seen: dict[int, RecordDict] = {}

    def group(node: int, msg: Message) -> None:
        seen[node] = msg.content
        return None  # nobody answers: the round times out, the model stays

    fed = federation(transport=transport, **{P.NUM_SERVER_ROUNDS: 1, P.ROUND_TIMEOUT: 0.5})
    strategy = ShardedFedAvg(fed)
    with live_grid(2, group) as grid:
        arrays = ArrayRecord({k: Array(v) for k, v in initial().items()})
        strategy.start(grid, arrays, num_rounds=1, timeout=30)
    nodes = sorted(seen)
    configs = [seen[n][P.CONFIG] for n in nodes]
    assert [c[P.GROUP_INDEX] for c in configs] == [0, 1]
    assert all(c[P.NUM_GROUPS] == 2 and c[P.ROUND_STEPS] == 2 for c in configs)
    if transport == P.FLOWER:  # the weights, packed in one Array
        packed = {k: v.numpy() for k, v in seen[nodes[0]][P.ARRAYS].items()}
        assert list(packed) == [P.PACKED] and np.array_equal(packed[P.PACKED], pack(initial()))
        assert P.SYNC_RANK not in configs[0]
    else:  # configs only, with each group's place in the round's sync
        assert P.ARRAYS not in seen[nodes[0]]
        assert [c[P.SYNC_RANK] for c in configs] == [0, 1]
        assert configs[0][P.COLLECTIVE_PREFIX].endswith("/round1")
    assert strategy.history[0][P.GROUPS_REJECTED] == 2
