"""The planner's memory model against the peak memory of real ``flower-shard train`` ranks (CPU).

For each K in (1, 2): an idle world of K ranks, each started as a training rank starts (torch,
transformers' Llama, torch.distributed with gloo, FSDP2, the rank's part of the corpus and one
batch loaded) that builds nothing and reports its resident set (VmRSS) once loaded; then, per
preset, one real run ``flower-shard train --groups 1 --nproc-per-group K`` (FSDP over K ranks,
float32, gloo, 2 steps), whose ranks' VmHWM (the kernel's own peak resident set) is sampled
with :class:`bench.memory.PeakSampler`. measured = a rank's VmHWM - an idle rank's VmRSS (means
over the ranks of each world); predicted = :func:`flower_shard.planning.memory.estimate`'s
``peak`` for that preset, batch, sequence length and S = K (``foreach=False``, AdamW's
per-tensor loop, the CPU default; nothing reserved). The batches make the training state
hundreds of MB: tiny's is almost all activations (its 0.1M parameters weigh nothing), small's
about half weights, gradients and AdamW state.

The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc's malloc then maps every block over
64 KiB on its own and unmaps it when freed, so the resident set follows the live tensors, the
CPU counterpart of ``torch.cuda.max_memory_allocated``. With glibc's default (a threshold that
rises to the largest block freed so far) freed activations and FSDP's gathered layers stay in
the heap and the resident set creeps up step after step: ``--default-malloc`` measured 1.41 to
1.43x the prediction for K = 1 and up to 1.91x for the small preset with K = 2 (FSDP's per-layer
all-gather buffers fragment the heap). That is the allocator's retention, the CPU counterpart
of the CUDA caching allocator's reserved-but-free memory, which the planner prices only
through ``--reserved-gb``.

What this checks, and what CPU cannot: the formulas for the float32 sharded weights, gradients
and AdamW state, the gathered FSDP units, the loss's float32 logits and the activations that
autograd saves (SDPA attention in float32), as a rank really holds them. It cannot check the
GPU-only terms: bf16 activations and compute copies (their formula was checked tensor by
tensor, not as process memory), GPU AdamW's foreach temporary, cuBLAS and NCCL workspaces, the
CUDA context, the caching allocator's fragmentation. The run ends by saving the final model
(rank 0 gathers the full weights), which stays under the training peak for these batches.

    .venv/bin/python bench/memory_model.py                   # four runs, ~2 min on 2 cores
    .venv/bin/python bench/memory_model.py --presets tiny --ranks 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memory import PeakSampler, command, vm_hwm, wait_sampling  # noqa: E402

from flower_shard import runfiles as F  # noqa: E402
from flower_shard.launch.agent import AGENT_MODULE  # noqa: E402
from flower_shard.launch.torchrun import TRAIN_MODULE  # noqa: E402
from flower_shard.planning.memory import StepSetup, estimate  # noqa: E402
from flower_shard.planning.shapes import preset_shape  # noqa: E402

IDLE_RANK = "--idle-rank"
TORCHRUN = "torch.distributed.run"
# The launchers whose command lines name the rank's module: never a rank themselves.
LAUNCHERS = (TORCHRUN, AGENT_MODULE)
RSS_FILE = "idle_rss_rank{rank}.json"
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# preset -> (batch size, seq len): states of hundreds of MB, runs of seconds.
BATCHES = {"tiny": (32, 512), "small": (4, 128)}
RANKS = (1, 2)


@dataclass(frozen=True)
class Check:
    """One (preset, K) row: the model's peak of a rank, and the measured increase."""

    preset: str
    ranks: int
    batch_size: int
    seq_len: int
    predicted_mb: float
    measured_mb: float
    rank_peak_mb: float
    idle_rss_mb: float

    @property
    def ratio(self) -> float:
        """Measured / predicted."""
        return self.measured_mb / self.predicted_mb


class RankSampler(PeakSampler):
    """A :class:`PeakSampler` that notices a rank's ``exec``: torchrun forks, then execs the
    rank's command, and a sample taken in between sees the launcher's command line and its
    memory. When the command line changes, the process is a new program: its peak restarts."""

    def sample(self) -> None:
        super().sample()
        for pid, (_, cmd) in list(self.peaks.items()):
            if _launcher(cmd) or cmd == "?":
                fresh = command(pid)
                if fresh not in (cmd, "?"):
                    self.peaks[pid] = (vm_hwm(pid), fresh)


def _launcher(cmd: str) -> bool:
    return any(name in cmd for name in LAUNCHERS)


def predicted_bytes(preset: str, ranks: int, batch_size: int, seq_len: int) -> float:
    """The memory model's peak of one rank of FSDP over ``ranks`` CPU ranks (float32)."""
    setup = StepSetup(batch_size=batch_size, seq_len=seq_len, foreach=False)
    return estimate(preset_shape(preset), setup, shard=ranks).peak


def sampled(cmd: list[str], marker: str, env: dict, timeout: float) -> list[int]:
    """Run ``cmd``, sampling its tree; the peaks of the processes whose command has ``marker``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    with RankSampler(proc.pid, interval=0.05) as sampler:
        rc = wait_sampling(proc, sampler, timeout)
    out = proc.stdout.read().decode(errors="replace")
    proc.stdout.close()
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {rc}:\n{out[-3000:]}")
    peaks = [p for p, c in sampler.peaks.values() if marker in c and not _launcher(c)]
    if not peaks:
        raise RuntimeError(f"no process with {marker!r} in its command line was sampled")
    return peaks


def train(preset: str, ranks: int, out: Path, env: dict, timeout: float) -> float:
    """A real run; the mean of its ranks' VmHWM in bytes."""
    batch, seq = BATCHES[preset]
    cmd = [sys.executable, "-m", "flower_shard.ux.cli", "train", "--out", str(out)]
    cmd += ["--model", preset, "--groups", "1", "--nproc-per-group", str(ranks)]
    cmd += ["--batch-size", str(batch), "--seq-len", str(seq), "--rounds", "1"]
    cmd += ["--local-steps", "2", "--eval-every", "0", "--device", "cpu", "--quiet"]
    return statistics.mean(sampled(cmd, TRAIN_MODULE, env, timeout))


def idle_rss(config: Path, ranks: int, env: dict, timeout: float) -> float:
    """An idle world on ``config``'s run; the mean of its ranks' loaded VmRSS in bytes."""
    cmd = [sys.executable, "-m", TORCHRUN, "--standalone", f"--nproc-per-node={ranks}"]
    sampled(cmd + [__file__, IDLE_RANK, str(config)], IDLE_RANK, env, timeout)
    files = [config.parent / RSS_FILE.format(rank=r) for r in range(ranks)]
    return statistics.mean(json.loads(f.read_text())["vm_rss"] for f in files)


def measure(
    presets: list[str], work: Path, env: dict, ranks_list=RANKS, timeout: float = 600
) -> list[Check]:
    """For each K of ``ranks_list``: the real runs of ``presets`` and one idle world."""
    checks = []
    for ranks in ranks_list:
        peaks = {p: train(p, ranks, work / f"{p}-k{ranks}", env, timeout) for p in presets}
        config = work / f"{presets[0]}-k{ranks}" / F.CONFIG_FILE
        idle = idle_rss(config, ranks, env, timeout)
        for p in presets:
            batch, seq = BATCHES[p]
            predicted = predicted_bytes(p, ranks, batch, seq)
            row = (predicted, peaks[p] - idle, peaks[p], idle)
            checks.append(Check(p, ranks, batch, seq, *(x / 1e6 for x in row)))
    return checks


def _resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def idle_rank(config_path: str) -> int:
    """A rank that starts as a training rank does, builds nothing, and writes its VmRSS."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard  # noqa: F401 - imported as a rank does
    from transformers import LlamaForCausalLM  # noqa: F401 - imported as a rank does

    from flower_shard.config import TrainConfig
    from flower_shard.runtime.data_part import DataPart
    from flower_shard.runtime.distributed import exit_now, init_distributed, shutdown
    from flower_shard.runtime.placement import Placement

    cfg = TrainConfig.from_json(config_path)
    place = Placement.whole_run(cfg, init_distributed(cfg.device))
    data = DataPart.load(Path(cfg.out, F.DATA_DIR), cfg, place)
    next(data.batches)
    path = Path(config_path).parent / RSS_FILE.format(rank=dist.get_rank())
    path.write_text(json.dumps({"vm_rss": _resident()}))
    shutdown(clean=True)
    exit_now()


def table(checks: list[Check]) -> str:
    rows = [
        f"{'preset':6s} {'K':>2s} {'batch x seq':>11s} {'predicted MB':>13s} "
        f"{'measured MB':>12s} {'ratio':>6s} {'rank VmHWM MB':>14s} {'idle VmRSS MB':>14s}"
    ]
    for c in checks:
        rows.append(
            f"{c.preset:6s} {c.ranks:2d} {f'{c.batch_size} x {c.seq_len}':>11s} "
            f"{c.predicted_mb:13.1f} {c.measured_mb:12.1f} {c.ratio:6.2f} "
            f"{c.rank_peak_mb:14.1f} {c.idle_rss_mb:14.1f}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [IDLE_RANK]:
        return idle_rank(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", choices=list(BATCHES), default=list(BATCHES))
    parser.add_argument(
        "--ranks", nargs="+", type=int, choices=RANKS, default=list(RANKS), help="the K to run"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="run the ranks with glibc's default mmap threshold (shows the heap's retention)",
    )
    args = parser.parse_args(argv)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    if not args.default_malloc:
        env.update(MMAP_THRESHOLD)
    with tempfile.TemporaryDirectory(prefix="memory-model-") as work:
        checks = measure(args.presets, Path(work), env, args.ranks)
    print(table(checks))
    if args.json:
        rows = [asdict(c) | {"ratio": c.ratio} for c in checks]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
