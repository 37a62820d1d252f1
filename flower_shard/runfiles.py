"""The names of what flower-shard writes into a run directory and a node's work directory.

A run directory is ``flower-shard train --out`` or a Flower run's ``out-dir``; every writer and
reader (trainer, ServerApp, launcher, report, export, tests, benchmarks) takes the names from
here.
"""

from __future__ import annotations

# -- a run directory ---------------------------------------------------------------------------
CONFIG_FILE = "config.json"  # flower-shard train: the TrainConfig that ran
METRICS_FILE = "metrics.jsonl"  # one record per round
SUMMARY_FILE = "summary.json"  # a Flower run: status ok/failed, model, tokenizer, seq_len
FINAL_MODEL = "final_model.safetensors"  # the final global model
DATA_DIR = "data"  # the prepared (tokenised) corpus: the four files below
TRAIN_TOKENS = "train.npy"  # the training stream
EVAL_TOKENS = "eval.npy"  # the held-out stream
CORPUS_META = "corpus.json"  # vocabulary, tokenizer and sizes (data.corpus.CorpusInfo)
TRAIN_DOCS = "train_docs.npz"  # per training document: start in train.npy, source, label
CHECKPOINTS_DIR = "checkpoints"  # checkpoints/group_G (train) or checkpoints/server (Flower)
SERVER_CHECKPOINTS = "server"
TENSORBOARD_DIR = "tensorboard"

# -- a node's work directory (flower-shard node --work-dir) ------------------------------------
GROUP_SOCKET = "group.sock"  # the group's control service
GROUP_LOG = "group.log"
SUPERNODE_LOG = "supernode.log"
RUN_FILE = "run.json"  # in a group's checkpoint folder: the settings of the run it belongs to


def group_checkpoints(group: int) -> str:
    """The folder of group ``group``'s checkpoints under CHECKPOINTS_DIR (one torch job)."""
    return f"group_{group}"
