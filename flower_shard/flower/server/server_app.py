"""The ServerApp: reads the run config, runs ShardedFedAvg, writes OUT/metrics.jsonl and the model.

Outputs in ``out-dir``: ``metrics.jsonl`` (one line per round, the group runtime's fields plus
``groups_ok``, ``groups_rejected``, ``rejected``, ``exchange_bytes``, ``round_s``,
``control_overhead_s``), ``final_model.safetensors`` (collective transport: fetched from a
group at the end), ``summary.json``
(status ``ok`` or ``failed`` with the reason: ``flwr run`` itself exits 0 either way; on success
also ``model``, ``tokenizer`` and ``seq_len``, which ``flower-shard export`` reads).
"""

from __future__ import annotations

import json
import math
import traceback
from datetime import timedelta
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import TrainConfig
from flower_shard.config.federation import FederationConfig
from flower_shard.preflight import check_federation
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
        info = prepare_corpus(out / "data", t.data, t.tokenizer, t.eval_fraction, t.text_column)
        self.blocks = eval_shard(out / "data", t.seq_len, t.eval_sequences, 0, 1)
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


def host_rendezvous(address: str, timeout_s: float):
    """The TCPStore where the groups meet (collective transport), listening on ``address`` only.

    torch's TCPStore listens on every interface whatever host it is given; a socket bound
    here to HOST:PORT and handed over (``master_listen_fd``) keeps it on the configured one.
    The store owns the socket from then on and closes it with itself.
    """
    import socket

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    listener = socket.create_server((host, int(port)))
    return dist.TCPStore(
        host,
        int(port),
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        timeout=timedelta(seconds=timeout_s),
    )


def initial_arrays(fed: FederationConfig, vocab_size: int) -> dict[str, np.ndarray]:
    """The first global model: the preset built from the run's seed, as float32 arrays."""
    from flower_shard.runtime.models import build_model

    t = fed.train
    model = build_model(t.model, vocab_size, t.seed, t.seq_len)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


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
        (out / F.SUMMARY_FILE).write_text(
            json.dumps(
                {
                    "status": "failed",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                },
                indent=2,
            )
            + "\n"
        )
        raise


def resume_point(fed: FederationConfig) -> tuple[dict[str, np.ndarray], dict]:
    """The global weights and the state to continue ``fed.train.resume`` from.

    The newest good server checkpoint; with the collective transport only a round whose group
    checkpoints exist (every ``checkpoint-every`` rounds), since the weights live in the groups.
    """
    t = fed.train
    found = C.latest_good(
        Path(t.resume, "checkpoints", "server"),
        accept=lambda r: fed.transport == "flower" or t.checkpoint_due(r),
        log=lambda m: log(WARNING, "%s", m),
    )
    if found is None:
        raise C.CheckpointError(
            f"resume {t.resume}: no good server checkpoint to continue from; start a new run"
        )
    arrays, outer, state = C.load_server(found[1])
    # safetensors stores names sorted; the outer state is flat in the model's order.
    arrays = {k: arrays[k] for k in state["order"]}
    C.restore_rng(state["rng"])
    log(INFO, "resuming %s after round %d (%s)", state["run_name"], state["round"], found[1])
    return arrays, {"round": state["round"], "outer": outer, **state}


def run(grid: Grid, fed: FederationConfig, out: Path) -> None:
    from flower_shard.flower.server.strategy import ShardedFedAvg

    t = fed.train
    evaluator = HeldOutEvaluator(fed, out)
    resumed = None
    if t.resume:
        first, resumed = resume_point(fed)
        M.keep_rounds(t.resume, out, resumed["round"])
    else:
        first = initial_arrays(fed, evaluator.model.config.vocab_size)
        (out / F.METRICS_FILE).unlink(missing_ok=True)
    # The run's identity for the groups' checkpoints: a resumed run continues the same one.
    run_name = resumed["run_name"] if resumed else str(out)
    logger = M.MetricsLogger(
        out,
        echo=not t.quiet,
        total_rounds=0 if t.adaptive_t else t.rounds,  # with adaptive-t the rounds vary
        tensorboard=t.tensorboard,
    )
    store = None
    if fed.transport == "collective":  # host the cross-group rendezvous for the groups
        store = host_rendezvous(fed.collective_address, fed.round_timeout)

    def on_round(record: dict) -> None:
        # Checkpoint first: a metrics line means its round is safe on disk.
        if t.checkpoint_every:
            C.save_server(
                out / "checkpoints" / "server",
                record[P.ROUND],
                strategy.global_arrays,
                strategy.outer.state_dict(),
                _jsonable(
                    {"history": strategy.history, "run_name": run_name, "order": strategy.order}
                ),
                keep=t.keep_checkpoints,
            )
        logger.log(_jsonable(record))

    strategy = ShardedFedAvg(fed, on_round=on_round)
    config = ConfigRecord(fed.group_config() | {P.RUN_NAME: run_name})
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({k: Array(v) for k, v in first.items()}),
        num_rounds=t.rounds,
        timeout=fed.round_timeout,
        train_config=config,
        evaluate_fn=evaluator if fed.transport == "flower" else None,
        resumed=resumed,
    )
    logger.close()
    from safetensors.numpy import save_file

    if fed.transport == "flower":
        final = {k: v.numpy() for k, v in result.arrays.items()}
    else:  # the groups hold the model: fetch it once from one of them
        final = strategy.final_weights(grid) if strategy.history else None
    if final is not None:
        save_file(final, str(out / F.FINAL_MODEL))
    summary = {
        "status": "ok",
        "rounds": len(strategy.history),
        "transport": fed.transport,
        "final": strategy.history[-1] if strategy.history else None,
        # What `flower-shard export` needs to rebuild the model around final_model.safetensors.
        "model": _resolved(t.model),
        "tokenizer": _resolved(t.tokenizer),
        "seq_len": t.seq_len,
    }
    (out / F.SUMMARY_FILE).write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
    del store


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
