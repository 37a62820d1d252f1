"""Every name that two parts of flower-shard must agree on, defined once: no magic strings.

Two vocabularies, one rule each:

- **configuration keys** are kebab-case (Flower's convention for run configs): the run config
  (``pyproject.toml`` ``[tool.flwr.app.config]``), the per-message config that every train or
  evaluate message carries to the groups (the same keys, so a group builds exactly the run the
  server was started with, plus the per-round keys below) and the node config;
- **metric names** are snake_case: the metrics a group replies with, the fields of
  ``metrics.jsonl``, TensorBoard's tags and the report read the same names, so a quantity has
  one name from the rank that measures it to the plot that shows it.

A pure leaf module (no imports): the ClientApp, the group, the server and the tools all read it.
"""

from __future__ import annotations

# -- transports ------------------------------------------------------------------------------
FLOWER = "flower"  # weights inside Flower Messages
COLLECTIVE = "collective"  # groups all-reduce their shards; Flower carries configs only
STREAMING = "streaming"  # every rank streams its shard to the aggregators over grpcio
TRANSPORTS = (FLOWER, COLLECTIVE, STREAMING)

# -- records inside a Flower Message ---------------------------------------------------------
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
# collective: the sync ranks (comma-separated) of the groups that catch up from the others
# before this round's inner steps (they (re)join mid-run); absent: none
SYNC_JOINERS = "sync-joiners"
PROBE = "probe"  # a QUERY message's config: answer whether the group is up, send no weights
RUN_ID = "run-id"  # Flower's id of the run: two runs never share a group's trainer
RUN_NAME = "run-name"  # the run's identity (its first out-dir): keys the groups' checkpoints
ROUND_STEPS = "round-steps"  # T of this round (the run's local-steps, or adaptive-t's choice)
ROUND_SECONDS = "round-seconds"  # time-budgeted rounds: train this long (0: round-steps)
RESUME_ROUND = "resume-round"  # > 0: the run resumes after this round; groups load its checkpoint
TICKET = "ticket"  # streaming: the round's ticket (JSON: aggregators' addresses, the token)
# streaming with outer-overlap: this round ends with a synchronous exchange (the last round, and
# each round that checkpoints): nothing stays in flight after it
OUTER_DRAIN = "outer-drain"
# flower transport with downlink-compression: the message's arrays are a compressed delta of
# this kind (absent: a float32 snapshot, PACKED) from the model version DOWNLINK_BASE that the
# group holds, giving version DOWNLINK_VERSION
DOWNLINK = "downlink"
DOWNLINK_BASE = "downlink-base"
DOWNLINK_VERSION = "downlink-version"
# The keys that change from round to round: everything else identifies the run.
PER_ROUND_KEYS = (
    SERVER_ROUND,
    COLLECTIVE_PREFIX,
    SYNC_RANK,
    SYNC_SIZE,
    SYNC_JOINERS,
    ROUND_STEPS,
    ROUND_SECONDS,
    TICKET,
    OUTER_DRAIN,
    DOWNLINK,
    DOWNLINK_BASE,
    DOWNLINK_VERSION,
)
# Begins the error a group returns when it gave up a cross-group sync (it is alive).
SYNC_ABANDONED = "cross-group sync abandoned"

# -- run config (pyproject [tool.flwr.app.config]) -------------------------------------------
NUM_SERVER_ROUNDS = "num-server-rounds"
LOCAL_STEPS = "local-steps"
TRANSPORT = "transport"
OUTER_OPTIMIZER = "outer-optimizer"
OUTER_LR = "outer-lr"
OUTER_OVERLAP = "outer-overlap"  # streaming: exchange round r's update while round r+1 trains
OUTER_MOMENTUM = "outer-momentum"
MIN_GROUPS = "min-groups"
DATA_PARTITIONS = "data-partitions"
ROUND_TIMEOUT = "round-timeout"
SYNC_TIMEOUT = "sync-timeout"
EVAL_EVERY = "eval-every"
OUT_DIR = "out-dir"
COLLECTIVE_ADDRESS = "collective-address"
POLL_INTERVAL = "poll-interval"
TEXT_COLUMN = "text-column"  # the records' text field; the groups read their node's --data with it
TENSORBOARD = "tensorboard"  # the ServerApp also writes out-dir/tensorboard (server side only)

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
    """A dataclass field's configuration key: ``seq_len`` -> ``seq-len``."""
    return field.replace("_", "-")


# -- node config (flower-supernode --node-config) ------------------------------------------------
GROUP_ADDRESS = "group-address"
PARTITION_ID = "partition-id"  # set by Flower's simulation engine for each virtual client
GROUP_ADDRESSES = "group-addresses"  # run config, simulation: comma-separated, by partition-id

# -- metric names: a group's reply, a metrics.jsonl record, a TensorBoard tag -----------------
ROUND = "round"
STEP = "step"  # inner steps so far
TOKENS = "tokens"  # tokens so far (metrics.jsonl); a group's entry in GROUPS: this round's
NUM_TOKENS = "num_tokens"  # a group's reply: the tokens it processed this round (its weight)
TOKENS_PER_S = "tokens_per_s"
TRAIN_LOSS = "train_loss"
EVAL_LOSS = "eval_loss"
EVAL_PPL = "eval_ppl"
# streaming: a group's evaluate reply, the seconds it took to pull the model it evaluated;
# a record: the slowest group's (exchange time the next TRAIN message then does not spend)
EVAL_PULL_S = "eval_pull_s"
LR = "lr"
ROUND_LOCAL_STEPS = "local_steps"  # T of this round (varies with adaptive-t, round-seconds)
ROUND_S = "round_s"
COMPUTE_S = "compute_s"  # the inner steps' wall clock, their intra-group collectives included
OUTER_SYNC_S = "outer_sync_s"
OUTER_SYNC_BYTES = "outer_sync_bytes"  # bytes one rank sent to other groups this round
OUTER_SYNC_PAYLOAD_BYTES = "outer_sync_payload_bytes"
INTRA_BYTES = "intra_bytes_per_rank"  # per round: what FSDP/HSDP's collectives sent (intra_comm)
INTRA_COMM_S = "intra_comm_s"  # per round: time in them (CPU: blocked, a part of compute_s)
INTRA_COMM = "intra_comm"  # per round: {allgather, reduce_scatter, replicate_allreduce}: calls, ...
INTER_BYTE_SHARE = "inter_byte_share"  # outer sync bytes / all bytes a rank sends
CHECKPOINT_S = "checkpoint_s"
GROUP = "group"  # a group's index
STEPS = "steps"  # a group's inner steps this round
# streaming with outer-overlap: 1 when the group streamed no update this round (its first round
# after pulling the global model: its update goes out while it trains the next one); then STEPS
# and NUM_TOKENS are this round's own, else those of the update it streamed
HELD_BACK = "held_back"
GROUP_ROUND_S = "group_round_s"  # a group's own time for the round (load, train, sync, save)
CLIENTAPP_PID = "clientapp_pid"  # the process that served the message (one per node when warm)
# What the ServerApp adds to a round's record.
GROUPS_OK = "groups_ok"
GROUPS_REJECTED = "groups_rejected"
GROUPS_DROPPED = "groups_dropped"
REJECTED = "rejected"  # the reasons, one line per rejected reply
EXCHANGE_BYTES = "exchange_bytes"  # bytes of weights in Flower messages this round (both ways)
PUSH_S = "push_s"
REPLY_WAIT_S = "reply_wait_s"
EVAL_S = "eval_s"
CONTROL_OVERHEAD_S = "control_overhead_s"
GROUPS = "groups"  # per valid group: GROUP, STEPS, TOKENS, COMPUTE_S, CLIENTAPP_PID

# Every record of metrics.jsonl has these.
REQUIRED_FIELDS = (
    ROUND,
    STEP,
    TOKENS,
    TOKENS_PER_S,
    TRAIN_LOSS,
    LR,
    OUTER_SYNC_S,
    OUTER_SYNC_BYTES,
)

# -- summary.json: the ServerApp's result of a Flower run (runfiles.SUMMARY_FILE) --------------
S_STATUS = "status"  # STATUS_OK or STATUS_FAILED (`flwr run` exits 0 either way)
STATUS_OK = "ok"
STATUS_FAILED = "failed"
S_ERROR = "error"  # failed: the exception, one line
S_TRACEBACK = "traceback"  # failed
S_ROUNDS = "rounds"  # ok: rounds run
S_TRANSPORT = "transport"
S_FINAL = "final"  # ok: the last round's metrics record
S_MODEL = "model"  # ok: what `flower-shard export` rebuilds the model from
S_TOKENIZER = "tokenizer"
S_SEQ_LEN = "seq_len"

# -- the group's local control service --------------------------------------------------------
SERVICE = "flower_shard.Group"
HEALTH = "Health"
TRAIN = "Train"
EVALUATE = "Evaluate"
GET_WEIGHTS = "GetWeights"
METHODS = (HEALTH, TRAIN, EVALUATE, GET_WEIGHTS)
# Header keys of a control-service request and reply.
H_METHOD = "method"
H_CONFIG = "config"
H_HAS_ARRAYS = "has_arrays"
H_COMMAND = "command"  # rank 0 numbers the commands it broadcasts (the abandon flags' keys)
H_METRICS = "metrics"
H_ERROR = "error"
# Health reply.
H_READY = "ready"
H_RANKS = "ranks"
H_STEP = "step"
