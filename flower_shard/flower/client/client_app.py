"""The ClientApp: converts Flower Messages to calls on the node's long-lived group, and back.

Deliberately thin, and free of torch: stock Flower starts a fresh process for every message
(flower-shard's nodes run it in one warm process, see
``flower_shard.flower.node.warm_superexec``). The group's address comes from the node config
key ``group-address`` (set by ``flower-shard node``). If the group does not answer, the
handler raises with a clear reason, which Flower returns to the server as an error reply.
"""

from __future__ import annotations

import os

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_shard import protocol as P
from flower_shard.flower.client.group_client import GroupClient

app = ClientApp()


def _group(context: Context) -> GroupClient:
    """The node's group: ``group-address`` (deployment) or entry ``partition-id`` of the run
    config's ``group-addresses`` (simulation, where virtual clients have no node config)."""
    address = context.node_config.get(P.GROUP_ADDRESS)
    listed = [a for a in str(context.run_config.get(P.GROUP_ADDRESSES, "")).split(",") if a]
    if not address and listed and P.PARTITION_ID in context.node_config:
        pid = int(context.node_config[P.PARTITION_ID])
        if pid >= len(listed):
            raise RuntimeError(
                f"virtual client {pid} has no entry in run config {P.GROUP_ADDRESSES!r} "
                f"({len(listed)} given): start one group per supernode"
            )
        address = listed[pid]
    if not address:
        raise RuntimeError(
            f"node config has no {P.GROUP_ADDRESS!r}: start the node with `flower-shard node`, "
            f"or pass --node-config \"{P.GROUP_ADDRESS}='unix:/path/group.sock'\""
        )
    return GroupClient(str(address))


def _forward(method: str, msg: Message, context: Context) -> Message:
    config = dict(msg.content[P.CONFIG]) if P.CONFIG in msg.content else {}
    arrays = None
    if P.ARRAYS in msg.content:
        arrays = {k: v.numpy() for k, v in msg.content[P.ARRAYS].items()}
    group = _group(context)
    try:
        header, out = group.call(method, {P.H_CONFIG: config}, arrays)
    finally:
        group.close()
    metrics = header.get(P.H_METRICS, {}) | {P.CLIENTAPP_PID: os.getpid()}
    content = RecordDict({P.METRICS: MetricRecord(metrics)})
    if out:
        content[P.ARRAYS] = ArrayRecord({k: Array(v) for k, v in out.items()})
    return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global weights (if sent), run T steps, reply with weights (flower) or metrics."""
    return _forward(P.TRAIN, msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Held-out loss of the group's model (after loading the sent weights, if any)."""
    return _forward(P.EVALUATE, msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The group's full weights (the collective transport's final model); with ``probe`` in
    the config only whether the group is up and ready (a dropped group's way back)."""
    if P.CONFIG in msg.content and P.PROBE in msg.content[P.CONFIG]:
        group = _group(context)
        try:
            ready = bool(group.health().get(P.H_READY))
        finally:
            group.close()
        content = RecordDict({P.METRICS: MetricRecord({P.H_READY: int(ready)})})
        return Message(content=content, reply_to=msg)
    return _forward(P.GET_WEIGHTS, msg, context)
