"""Start the ranks of a run with torchrun on this host, supervise them, and stop them all.

The launcher does everything that can fail cheaply before a single rank starts: it validates the
configuration, refuses an ``--out`` that holds another run's checkpoints, checks a run to
resume (its checkpoints' run, group and settings), prepares the corpus, and checks that the
data fits the topology. Then it runs torchrun (:mod:`flower_shard.launch.agent`: its rendezvous
store on 127.0.0.1 for a one-host job, ranks that die with it) in its own session (process
group); SIGINT/SIGTERM, or the launcher's own exit, stop that whole process tree, and its
death (even SIGKILL) stops torchrun. Checkpoint staging left by an interrupted save is removed
when the ranks are gone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from flower_shard import runfiles as F
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.config import identity as I
from flower_shard.config.ranges import check_address
from flower_shard.config.train import MAX_LOCAL_RANKS
from flower_shard.launch.agent import AGENT_MODULE, LOOPBACK, LOOPBACK_INTERFACE, SOCKET_IFNAME_ENVS
from flower_shard.launch.processes import start_marked, stop_tree
from flower_shard.preflight import check, check_out, check_run_dir, prepare_for
from flower_shard.runtime import checkpoint as C
from flower_shard.threads import with_threads

log = logging.getLogger(__name__)

TRAIN_MODULE = "flower_shard.launch.job"  # what torchrun runs on every rank (one torch job)


def torchrun_command(
    cfg: TrainConfig,
    config_path: str | Path,
    *,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    module: str = TRAIN_MODULE,
) -> list[str]:
    """The torchrun command line that starts this host's N / nnodes ranks (static
    rendezvous; on one host, its store on 127.0.0.1 and a free port)."""
    cfg.validate()
    local = cfg.world_size // cfg.nnodes
    if local > MAX_LOCAL_RANKS:
        raise ConfigError(
            f"N / nnodes = {local} ranks on this host: at most {MAX_LOCAL_RANKS}; use fewer "
            "ranks or more hosts (--nnodes)"
        )
    cmd = [sys.executable, "-m", AGENT_MODULE, f"--nproc-per-node={local}"]
    if cfg.nnodes == 1 and rdzv_endpoint is None:
        return cmd + [
            "--nnodes=1",
            "--node-rank=0",
            f"--master-addr={LOOPBACK}",
            "--master-port=0",  # the agent binds a free one
            "-m",
            module,
            str(config_path),
        ]
    if rdzv_endpoint is None:
        raise ConfigError(
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT: host 0's address, the same on every host"
        )
    host, port = check_address("--rdzv-endpoint", rdzv_endpoint)
    if not 0 <= node_rank < cfg.nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be in [0, --nnodes {cfg.nnodes})")
    # Static rendezvous: host I gets ranks I*N/H .. (I+1)*N/H-1, so groups (consecutive
    # ranks) map onto hosts as planned and rank 0 (which writes the metrics) is on host
    # 0. torchrun's c10d rendezvous would order hosts by arrival and ignore --node-rank.
    return cmd + [
        f"--nnodes={cfg.nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={host}",
        f"--master-port={port}",
        "-m",
        module,
        str(config_path),
    ]


def worker_env(cfg: TrainConfig) -> dict[str, str]:
    """Environment of the ranks: one share of the host's cores each, quiet libraries, and, on
    one host, gloo and NCCL on the loopback interface (unless the environment names one)."""
    env = with_threads(dict(os.environ), cfg.world_size // cfg.nnodes)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cfg.nnodes == 1:
        for name in SOCKET_IFNAME_ENVS:
            env.setdefault(name, LOOPBACK_INTERFACE)
    return env


def check_resume(cfg: TrainConfig) -> str:
    """``--resume``: the run's name, once every group's checkpoints were found to be that
    run's, that group's and of compatible settings (changes that are allowed are logged);
    :class:`ConfigError` (one line) otherwise, before any rank starts. The checksums are
    verified by the ranks themselves when they load."""
    # Imported here: it brings torch, which the launcher needs for nothing else.
    from flower_shard.runtime.group_checkpoint import REQUIRED, check_metadata, checkpoint_root

    run, notes, ready = None, set(), []
    for g in range(cfg.groups):
        root = checkpoint_root(cfg.resume, g)
        if root.is_symlink():
            raise ConfigError(f"--resume: {root} is a symbolic link; each group has its own")
        good = []
        for rnd in C.rounds(root):
            path = C.round_dir(root, rnd)
            reason = C.verify(path, REQUIRED, checksums=False)
            if reason:
                log.warning("checkpoint refused: %s", reason)
                continue
            try:
                identity = C.read_identity(path)
            except C.CheckpointError as exc:
                raise ConfigError(f"--resume: {exc}") from None
            run = I.check_identity(identity, run, g, str(path))
            try:  # a tampered DCP index is refused here, before any rank would read it
                check_metadata(path)
            except C.CheckpointError as exc:
                raise ConfigError(f"--resume: {exc}") from None
            notes.update(I.compare(identity.get(I.SETTINGS, {}), I.train_settings(cfg), str(path)))
            good.append(rnd)
        ready.append(set(good))
    if run is None or not set.intersection(*ready):
        raise ConfigError(
            f"--resume {cfg.resume}: no round has a checkpoint in every one of the "
            f"{cfg.groups} groups; give the output directory of a run with --checkpoint-every "
            "> 0 (and the same --groups), or start afresh"
        )
    for note in sorted(notes):
        log.warning("resume: setting changed, allowed: %s", note)
    return run


def prepare_run(cfg: TrainConfig) -> Path:
    """Check, prepare the corpus into OUT/data, write OUT/config.json and each group's
    checkpoint identity; return the config's path."""
    check(cfg)
    check_out(cfg)
    out = Path(cfg.out)
    run = check_resume(cfg) if cfg.resume is not None else None
    check_run_dir(out, run)
    run = run or I.new_run_name()
    out.mkdir(parents=True, exist_ok=True)
    prepare_for(out / F.DATA_DIR, cfg)
    metrics = out / F.METRICS_FILE
    if metrics.exists() and cfg.resume is None:  # a new run in the same directory: a new log
        metrics.unlink()
    settings = I.train_settings(cfg)
    from flower_shard.runtime.group_checkpoint import checkpoint_root  # torch: after the checks

    for g in range(cfg.groups):  # what every checkpoint of the group will record
        root = checkpoint_root(out, g)
        root.mkdir(parents=True, exist_ok=True)
        C.write_identity(root, I.make_identity(run, g, settings))
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
    """Prepare the run and start this host's ranks; returns torchrun's exit status. Whatever
    way it ends (a signal included), a one-host run's staging directories of an interrupted
    save are removed once the ranks are gone."""
    config_path = Path(cfg.out, F.CONFIG_FILE)
    # The command first: its own checks (ranks per host, the rendezvous endpoint) fail
    # before anything is written.
    cmd = torchrun_command(cfg, config_path, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
    prepare_run(cfg)
    log.info("settings that differ from the defaults: %s", cfg.non_defaults())
    try:
        return run_supervised(cmd, worker_env(cfg))
    finally:
        # Only on one host: on several, another host's ranks may still be writing.
        if cfg.nnodes == 1:
            for removed in C.clean_staging(Path(cfg.out, F.CHECKPOINTS_DIR)):
                log.warning("removed %s, left by an interrupted checkpoint save", removed)
