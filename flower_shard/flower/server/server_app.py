"""The ServerApp: reads the run config, runs ShardedFedAvg, writes OUT/metrics.jsonl and the model.

Outputs in ``out-dir``: ``metrics.jsonl`` (one line per round:
:meth:`~flower_shard.flower.server.stats.RoundStats.record`), ``final_model.safetensors`` (the
strategy's final model: the server's global one, or, where the groups hold the model, fetched
from one of them at the end), ``summary.json`` (status ``ok`` or ``failed`` with the reason:
``flwr run`` itself exits 0 either way; on success also ``model``, ``tokenizer`` and
``seq_len``, which ``flower-shard export`` reads).
"""

from __future__ import annotations

import json
import math
import os
import traceback
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import TrainConfig
from flower_shard.config import identity as I
from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server.strategy import ResumePoint, ShardedFedAvg
from flower_shard.flower.server.transports import transport_class
from flower_shard.preflight import check_federation, check_run_dir
from flower_shard.runtime import checkpoint as C
from flower_shard.ux import metrics as M

app = ServerApp()


class HeldOutEvaluator:
    """Server-side held-out loss of a global model: the same sequences the groups evaluate."""

    def __init__(self, fed: FederationConfig, out: Path):
        from flower_shard.data.batches import eval_shard
        from flower_shard.data.corpus import prepare_corpus
        from flower_shard.runtime.models import build_model

        t = fed.train
        data = out / F.DATA_DIR
        info = prepare_corpus(data, t.data, t.tokenizer, t.eval_fraction, t.text_column)
        self.blocks = eval_shard(data, t.seq_len, t.eval_sequences, 0, 1)
        self.batch_size = t.batch_size
        self.model = build_model(t.model, info.vocab_size, t.seed, t.seq_len)
        self.model.eval()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        import torch

        from flower_shard.runtime.evaluation import loss_sums

        state = {k: torch.from_numpy(v.numpy()) for k, v in arrays.items()}
        self.model.load_state_dict(state, strict=True)
        total = loss_sums(self.model, self.blocks, self.batch_size)
        return MetricRecord({P.EVAL_LOSS: (total[0] / total[1]).item()})


def initial_arrays(fed: FederationConfig, out: Path) -> dict[str, np.ndarray]:
    """The first global model as float32 arrays, without a second copy: the model built from
    the run's seed (the arrays are views of its tensors), or, for a preset built on the meta
    device (the 8B one), each parameter drawn on its own as the streaming aggregators draw it
    (:mod:`flower_shard.dataplane.init`)."""
    from flower_shard.dataplane.init import initial_weights
    from flower_shard.dataplane.layout import Param
    from flower_shard.runtime.models import build_model, is_meta

    t = fed.train
    vocab = run_vocab_size(fed, out)
    model = build_model(t.model, vocab, t.seed, t.seq_len)
    if is_meta(model):
        spec = {"kind": "model", "model": t.model, "vocab_size": vocab, "seed": t.seed}
        params = [Param(0, n, tuple(p.shape), 0) for n, p in model.named_parameters()]
        return initial_weights(spec | {"seq_len": t.seq_len}, params)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def run_vocab_size(fed: FederationConfig, out: Path) -> int:
    """The vocabulary of the run's tokenizer (the corpus is prepared for the evaluation)."""
    from flower_shard.data.corpus import prepare_corpus

    t = fed.train
    info = prepare_corpus(out / F.DATA_DIR, t.data, t.tokenizer, t.eval_fraction, t.text_column)
    return info.vocab_size


@app.main()
def main(grid: Grid, context: Context) -> None:
    from flower_shard.flower.node.fast_supernode import fast_object_pulls

    fast_object_pulls()  # the replies' objects: 50 ms retries, not Flower's 1 s
    run_config = dict(context.run_config)
    # Where to report, even when the rest of the run config is wrong.
    out = Path(str(run_config.get(P.OUT_DIR) or TrainConfig.out)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        fed = check_federation(FederationConfig.from_run_config(run_config))
        out = Path(fed.train.out).resolve()
        out.mkdir(parents=True, exist_ok=True)
        run(grid, fed, out)
    except Exception as exc:
        failed = {
            P.S_STATUS: P.STATUS_FAILED,
            P.S_ERROR: f"{type(exc).__name__}: {exc}",
            P.S_TRACEBACK: traceback.format_exc(),
        }
        _write_summary(out, failed)
        raise


# The server checkpoint's JSON state, besides the round and RNG that checkpoint.save_server adds.
HISTORY, RUN_NAME, ORDER, SLOTS = "history", "run_name", "order", "data_slots"


def resume_point(fed: FederationConfig) -> tuple[dict[str, np.ndarray], ResumePoint]:
    """The global weights and the state to continue ``fed.train.resume`` from.

    The newest good server checkpoint; where the groups hold the model (the collective
    transport) only a round whose group checkpoints exist (every ``checkpoint-every`` rounds).
    """
    t = fed.train
    kind = transport_class(fed.transport)
    in_groups = kind.groups_hold_model
    found = C.latest_good(
        Path(t.resume, F.CHECKPOINTS_DIR, F.SERVER_CHECKPOINTS),
        accept=lambda r: not in_groups or t.checkpoint_due(r),
        log=lambda m: log(WARNING, "%s", m),
    )
    if found is None:
        raise C.CheckpointError(
            f"resume {t.resume}: no good server checkpoint to continue from; start a new run"
        )
    arrays, outer, state = C.load_server(found[1])
    # The checkpoint's run and settings, checked before any group hears of the run.
    identity = C.read_identity(found[1])
    I.check_identity(identity, state[RUN_NAME], None, str(found[1]))
    for note in I.compare(identity.get(I.SETTINGS, {}), I.federation_settings(fed), t.resume):
        log(WARNING, "resume: setting changed, allowed: %s", note)
    # safetensors stores names sorted; the outer state is flat in the model's order. A
    # transport whose model lives elsewhere (streaming: the aggregators' files) saved none.
    arrays = {k: arrays[k] for k in state[ORDER]} if kind.needs_initial_arrays else {}
    C.restore_rng(state["rng"])
    point = ResumePoint(
        state["round"], outer, state[HISTORY], state[RUN_NAME], str(found[1]), state.get(SLOTS)
    )
    log(INFO, "resuming %s after round %d (%s)", point.run_name, point.round, found[1])
    return arrays, point


def run(grid: Grid, fed: FederationConfig, out: Path) -> None:
    """Run the strategy to the end; write the metrics, the final model and the summary."""
    from safetensors.numpy import save_file

    t = fed.train
    kind = transport_class(fed.transport)
    # Where the groups hold the model, they evaluate it; the ServerApp builds none.
    evaluator = None if kind.groups_hold_model else HeldOutEvaluator(fed, out)
    resumed = None
    if t.resume:
        first, resumed = resume_point(fed)
        check_run_dir(out, resumed.run_name, flag="out-dir")
        M.keep_rounds(t.resume, out, resumed.round)
    else:
        check_run_dir(out, None, flag="out-dir")  # a new run never mixes with an old one
        first = initial_arrays(fed, out) if kind.needs_initial_arrays else {}
        (out / F.METRICS_FILE).unlink(missing_ok=True)
    # The run's identity for the groups' checkpoints: a resumed run continues the same one.
    run_name = resumed.run_name if resumed else str(out)
    logger = M.MetricsLogger(
        out,
        echo=not t.quiet,
        total_rounds=0 if t.adaptive_t else t.rounds,  # with adaptive-t the rounds vary
        tensorboard=t.tensorboard,
    )
    strategy = ShardedFedAvg(fed)
    strategy.on_round = round_recorder(strategy, fed, out, run_name, logger)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(),
        initial_weights=first,  # taken by the transport, without a copy (the dict is emptied)
        num_rounds=t.rounds,
        timeout=fed.round_timeout,
        train_config=ConfigRecord(fed.group_config() | {P.RUN_NAME: run_name}),
        evaluate_fn=evaluator,
        resumed=resumed,
    )
    logger.close()
    if strategy.final_weights:
        final = {k: np.ascontiguousarray(v) for k, v in strategy.final_weights.items()}
        save_file(final, str(out / F.FINAL_MODEL))
    summary = {
        P.S_STATUS: P.STATUS_OK,
        P.S_ROUNDS: len(strategy.history),
        P.S_TRANSPORT: fed.transport,
        P.S_FINAL: strategy.history[-1] if strategy.history else None,
        # What `flower-shard export` needs to rebuild the model around final_model.safetensors.
        P.S_MODEL: _resolved(t.model),
        P.S_TOKENIZER: _resolved(t.tokenizer),
        P.S_SEQ_LEN: t.seq_len,
    }
    _write_summary(out, _jsonable(summary))


def round_recorder(strategy, fed: FederationConfig, out: Path, run_name: str, logger):
    """What the ServerApp does after each round: checkpoint first (a metrics line means its
    round is safe on disk), then write the round's metrics line."""
    t = fed.train

    def on_round(record: dict) -> None:
        if t.checkpoint_every:
            transport = strategy.transport
            state = {
                HISTORY: strategy.history,
                RUN_NAME: run_name,
                ORDER: transport.order,
                SLOTS: strategy.slots.state_dict(),
            }
            C.save_server(
                out / F.CHECKPOINTS_DIR / F.SERVER_CHECKPOINTS,
                record[P.ROUND],
                transport.global_arrays,
                transport.state_dict(),
                _jsonable(state),
                keep=t.keep_checkpoints,
                extra=transport.save_files,
                identity=I.make_identity(run_name, None, I.federation_settings(fed)),
            )
        logger.log(_jsonable(record))

    return on_round


def _resolved(path: str | None) -> str | None:
    """A local path made absolute (the run dir may be read from elsewhere); presets unchanged."""
    from flower_shard.config.presets import is_preset

    if not path or is_preset(path) or not Path(path).exists():
        return path
    return str(Path(path).resolve())


def _jsonable(obj):
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj


def _write_summary(out: Path, summary: dict) -> None:
    """Write summary.json whole or not at all: launchers poll for it and read it at once."""
    tmp = out / (F.SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / F.SUMMARY_FILE)
