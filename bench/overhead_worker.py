"""One side of bench/overhead.py, run under torchrun: time S inner steps, report peak RSS.

argv: MODE(runtime|bare) CONFIG_JSON DATA_DIR WARMUP STEPS RESULT_JSON
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from flower_shard.config import TrainConfig
from flower_shard.data.batches import rank_batches
from flower_shard.data.corpus import CorpusInfo
from flower_shard.runtime.distributed import exit_now, shutdown
from flower_shard.runtime.evaluation import lm_loss
from flower_shard.runtime.trainer import build_job_trainer


def peak_rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bare_loop(cfg: TrainConfig, data_dir: str):
    """A plain FSDP2 loop, written out: no runtime, no metrics, no outer sync object."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flower_shard.runtime.distributed import init_distributed
    from flower_shard.runtime.models import build_model

    init_distributed("cpu")
    k = cfg.nproc_per_group
    mesh = init_device_mesh("cpu", (cfg.groups, k), mesh_dim_names=("group", "shard"))
    rank = dist.get_rank()
    model = build_model(cfg.model, CorpusInfo.load(data_dir).vocab_size, cfg.seed, cfg.seq_len)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    batches = rank_batches(
        data_dir, cfg.seq_len, cfg.batch_size, cfg.groups, k, rank // k, rank % k, cfg.seed
    )

    def step():
        x, y = next(batches)
        loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def runtime_loop(cfg: TrainConfig, data_dir: str):
    trainer = build_job_trainer(cfg, data_dir)
    return lambda: trainer.train_step(*next(trainer.data.batches))


def main():
    mode, cfg_path, data_dir, warmup, steps, result = sys.argv[1:7]
    cfg = TrainConfig.from_json(cfg_path)
    step = (runtime_loop if mode == "runtime" else bare_loop)(cfg, data_dir)
    for _ in range(int(warmup)):
        step().item()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(steps)):
        step()
    step().item()
    dist.barrier()
    seconds = time.perf_counter() - start
    rss = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    tokens = (int(steps) + 1) * cfg.batch_size * cfg.seq_len * cfg.world_size
    if dist.get_rank() == 0:
        with open(result, "w") as fh:
            json.dump(
                {
                    "mode": mode,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "peak_rss_mib_max_rank": rss.item(),
                },
                fh,
            )
    shutdown(clean=True)  # a barrier first: see shutdown
    exit_now()


if __name__ == "__main__":
    main()
