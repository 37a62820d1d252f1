"""Names and encodings shared by the server, the ClientApp and the group: no magic strings.

Run-config keys are kebab-case (Flower's convention); the same keys travel in each train
message's ConfigRecord, so a group builds exactly the run the server was started with.
"""

from __future__ import annotations

import json
import struct

import numpy as np

# -- records inside a Flower Message -----------------------------------------------------------
ARRAYS = "arrays"
PACKED = "packed"  # flower transport: every weight in one flat float32 Array, names sorted
CONFIG = "config"
METRICS = "metrics"

# -- per-message config keys (besides the run config below) -----------------------------------
SERVER_ROUND = "server-round"
GROUP_INDEX = "group-index"
NUM_GROUPS = "num-groups"
COLLECTIVE_PREFIX = "collective-prefix"
SYNC_RANK = "sync-rank"  # collective: this group's place among the round's live groups
SYNC_SIZE = "sync-size"  # collective: how many live groups sync this round
# Begins the error a group returns when it gave up a cross-group sync (it is alive).
SYNC_ABANDONED = "cross-group sync abandoned"
RUN_ID = "run-id"  # Flower's id of the run: two runs never share a group's trainer
RUN_NAME = "run-name"  # the run's identity (its first out-dir): keys the groups' checkpoints
ROUND_STEPS = "round-steps"  # T of this round (the run's local-steps, or adaptive-t's choice)
ROUND_SECONDS = "round-seconds"  # time-budgeted rounds: train this long (0: round-steps)
RESUME_ROUND = "resume-round"  # > 0: the run resumes after this round; groups load its checkpoint

# -- reply metrics ------------------------------------------------------------------------------
NUM_TOKENS = "num-tokens"  # the aggregation weight: tokens the group processed this round
TRAIN_LOSS = "train-loss"
EVAL_LOSS = "eval-loss"
COMPUTE_S = "compute-s"
INTRA_BYTES = "intra-bytes"  # what the group's FSDP/HSDP collectives sent per rank this round
INTRA_COMM_S = "intra-comm-s"  # the time in them (flower_shard.runtime.intra_comm)
GROUP_ROUND_S = "group-round-s"
SYNC_S = "sync-s"
SYNC_BYTES = "sync-bytes"
CHECKPOINT_S = "checkpoint-s"
STEP = "step"
CLIENTAPP_PID = "clientapp-pid"  # the process that served the message (one per node when warm)

# -- run config (pyproject [tool.flwr.app.config]) -------------------------------------------
NUM_SERVER_ROUNDS = "num-server-rounds"
LOCAL_STEPS = "local-steps"
TRANSPORT = "transport"
OUTER_OPTIMIZER = "outer-optimizer"
OUTER_LR = "outer-lr"
OUTER_MOMENTUM = "outer-momentum"
MIN_GROUPS = "min-groups"
ROUND_TIMEOUT = "round-timeout"
SYNC_TIMEOUT = "sync-timeout"
EVAL_EVERY = "eval-every"
OUT_DIR = "out-dir"
COLLECTIVE_ADDRESS = "collective-address"
POLL_INTERVAL = "poll-interval"
TEXT_COLUMN = "text-column"  # the records' text field; the groups read their node's --data with it
TENSORBOARD = "tensorboard"  # the ServerApp also writes out-dir/tensorboard (server side only)

TRANSPORTS = ("flower", "collective")

# TrainConfig fields that a group needs, under their kebab-case run-config names.
GROUP_FIELDS = (
    "model",
    "seq_len",
    "batch_size",
    "lr",
    "min_lr_ratio",
    "warmup_frac",
    "weight_decay",
    "grad_clip",
    "bf16",
    "seed",
    "sharding",
    "replicate",
    "eval_fraction",
    "text_column",
    "partition",
    "partition_label",
    "dirichlet_alpha",
    "eval_sequences",
    "sync_optimizer_state",
    "compression",
    "compression_chunk",
    "error_feedback",
    "tokenizer",
    "checkpoint_every",
    "keep_checkpoints",
)


def kebab(field: str) -> str:
    return field.replace("_", "-")


# -- node config (flower-supernode --node-config) ------------------------------------------------
GROUP_ADDRESS = "group-address"
PARTITION_ID = "partition-id"  # set by Flower's simulation engine for each virtual client
GROUP_ADDRESSES = "group-addresses"  # run config, simulation: comma-separated, by partition-id

# -- the group's local control service --------------------------------------------------------
SERVICE = "flower_shard.Group"
HEALTH = "Health"
TRAIN = "Train"
EVALUATE = "Evaluate"
GET_WEIGHTS = "GetWeights"
METHODS = (HEALTH, TRAIN, EVALUATE, GET_WEIGHTS)
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def encode(header: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """A control-service message: 4-byte header length, JSON header, then safetensors bytes."""
    from safetensors.numpy import save

    head = json.dumps(header).encode()
    body = save(arrays) if arrays else b""
    return struct.pack("<I", len(head)) + head + body


def decode(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load

    (n,) = struct.unpack_from("<I", data)
    header = json.loads(data[4 : 4 + n])
    body = data[4 + n :]
    return header, (load(body) if body else {})
