"""Start the ranks of a run with torchrun on this host, supervise them, and stop them all.

The launcher does everything that can fail cheaply before a single rank starts: it validates the
configuration, prepares the corpus, and checks that the data fits the topology. Then it runs
torchrun in its own session (process group); SIGINT/SIGTERM, or the launcher's own exit, stop
that whole process tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from flower_shard import runfiles as F
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.launch.processes import start_marked, stop_tree
from flower_shard.preflight import check, prepare_for
from flower_shard.threads import with_threads

TRAIN_MODULE = "flower_shard.launch.job"  # what torchrun runs on every rank (one torch job)


def torchrun_command(
    cfg: TrainConfig,
    config_path: str | Path,
    *,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    module: str = TRAIN_MODULE,
) -> list[str]:
    """The torchrun command line that starts this host's N / nnodes ranks."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.world_size // cfg.nnodes}",
    ]
    if cfg.nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        host, _, port = (rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT: host 0's address, the same on "
                "every host"
            )
        if not 0 <= node_rank < cfg.nnodes:
            raise ConfigError(f"--node-rank {node_rank} must be in [0, --nnodes {cfg.nnodes})")
        # Static rendezvous: host I gets ranks I*N/H .. (I+1)*N/H-1, so groups (consecutive
        # ranks) map onto hosts as planned and rank 0 (which writes the metrics) is on host
        # 0. torchrun's c10d rendezvous would order hosts by arrival and ignore --node-rank.
        cmd += [
            f"--nnodes={cfg.nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]
    return cmd + ["-m", module, str(config_path)]


def worker_env(cfg: TrainConfig) -> dict[str, str]:
    """Environment of the ranks: one share of the host's cores each, quiet libraries."""
    env = with_threads(dict(os.environ), cfg.world_size // cfg.nnodes)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def prepare_run(cfg: TrainConfig) -> Path:
    """Check, prepare the corpus into OUT/data, write OUT/config.json; return its path."""
    check(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    prepare_for(out / F.DATA_DIR, cfg)
    metrics = out / F.METRICS_FILE
    if metrics.exists() and cfg.resume is None:  # a new run in the same directory: a new log
        metrics.unlink()
    path = out / F.CONFIG_FILE
    cfg.to_json(path)
    return path


def run_supervised(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None, **popen
) -> int:
    """Run ``cmd`` in its own session; on SIGINT/SIGTERM, timeout or any exit, stop its whole tree.

    Returns the exit status, or 124 (as timeout(1) does) when ``timeout`` seconds passed.
    """
    proc, marker = start_marked(cmd, env, **popen)

    def forward(signum, _frame):
        stop_tree(proc, marker)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124
    finally:
        stop_tree(proc, marker)
        for s, handler in previous.items():
            signal.signal(s, handler)


def launch_train(cfg: TrainConfig, *, node_rank: int = 0, rdzv_endpoint: str | None = None) -> int:
    """Prepare the run and start this host's ranks; returns torchrun's exit status."""
    config_path = prepare_run(cfg)
    cmd = torchrun_command(cfg, config_path, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
    return run_supervised(cmd, worker_env(cfg))
