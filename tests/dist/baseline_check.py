"""Under torchrun: G = 1 runtime vs a hand-written plain FSDP2 loop vs one process, same batches.

argv: CONFIG_JSON DATA_DIR OUT_DIR. Rank 0 saves OUT/baseline.pt with the per-step losses of
all three and the final full weights of the first two.
"""

import sys

import torch
import torch.distributed as dist
from common import full_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from flower_shard.config import TrainConfig
from flower_shard.data.batches import rank_batches
from flower_shard.runtime.evaluation import lm_loss
from flower_shard.runtime.models import build_model
from flower_shard.runtime.schedule import warmup_cosine
from flower_shard.runtime.trainer import build_job_trainer
from flower_shard.runtime.distributed import exit_now

cfg_path, data_dir, out = sys.argv[1:4]
cfg = TrainConfig.from_json(cfg_path)
assert cfg.groups == 1
steps = cfg.total_steps
n = cfg.world_size


def world_mean(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / n


def make_optimizer(params):
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay
    )
    warmup = int(cfg.warmup_frac * steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, steps, warmup, cfg.min_lr_ratio)
    )
    return opt, sched


def batches_of(rank):
    return rank_batches(data_dir, cfg.seq_len, cfg.batch_size, 1, n, 0, rank, cfg.seed)


# 1. The runtime with G = 1.
trainer = build_job_trainer(cfg, data_dir)
rank = trainer.place.rank
runtime_losses = [world_mean(trainer.train_step(*next(trainer.data.batches))) for _ in range(steps)]
runtime_final = full_state(trainer.model)

# 2. Plain FSDP2 written out by hand: each block, then the root, over a 1-D mesh of all ranks.
mesh = init_device_mesh("cpu", (n,))
model = build_model(cfg.model, trainer.data.corpus.vocab_size, cfg.seed, cfg.seq_len)
for block in model.model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt, sched = make_optimizer(model.parameters())
batches = batches_of(rank)
plain_losses = []
for _ in range(steps):
    x, y = next(batches)
    loss = lm_loss(model, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad()
    plain_losses.append(world_mean(loss))
plain_final = full_state(model)

# 3. One process, the N ranks' batches concatenated into one global batch.
if rank == 0:
    single = build_model(cfg.model, trainer.data.corpus.vocab_size, cfg.seed, cfg.seq_len)
    opt, sched = make_optimizer(single.parameters())
    iters = [batches_of(r) for r in range(n)]
    single_losses = []
    for _ in range(steps):
        xs, ys = zip(*(next(it) for it in iters))
        loss = lm_loss(single, torch.cat(xs), torch.cat(ys))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(single.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        single_losses.append(loss.item())
    torch.save(
        {
            "runtime": runtime_losses,
            "plain": plain_losses,
            "single": single_losses,
            "runtime_final": runtime_final,
            "plain_final": plain_final,
            "single_final": {k: v.detach() for k, v in single.named_parameters()},
        },
        f"{out}/baseline.pt",
    )
trainer.close(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
