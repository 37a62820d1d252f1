"""Under torchrun: train G groups apart for a few steps, then outer-sync; save before/after.

argv: CONFIG_JSON DATA_DIR OUT_DIR
Saves, per round r and group g: pre_r{r}_g{g}.pt and post_r{r}_g{g}.pt (full tensors gathered
per group), init_g{g}.pt (weights before training), and meta_g{g}.pt (a tiny model built on the
meta device, sharded, then materialised).
"""

import sys

import torch
from common import full_moments, full_state, save_from_group_leader

from flower_shard.config import TrainConfig
from flower_shard.runtime.models import build_model, materialize
from flower_shard.runtime.parallelize import parallelize
from flower_shard.runtime.trainer import build_job_trainer
from flower_shard.runtime.distributed import exit_now

cfg_path, data_dir, out = sys.argv[1:4]
cfg = TrainConfig.from_json(cfg_path)
trainer = build_job_trainer(cfg, data_dir)
k = trainer.place.group_size
g = trainer.place.group
save_from_group_leader(full_state(trainer.model), f"{out}/init_g{g}.pt", k)
for r in range(cfg.rounds):
    for _ in range(cfg.local_steps):
        x, y = next(trainer.data.batches)
        trainer.train_step(x, y)
    pre = full_state(trainer.model)
    if cfg.sync_optimizer_state:
        pre |= full_moments(trainer.model, trainer.optimizer)
    save_from_group_leader(pre, f"{out}/pre_r{r}_g{g}.pt", k)
    stats = trainer.outer.sync()
    post = full_state(trainer.model)
    if cfg.sync_optimizer_state:
        post |= full_moments(trainer.model, trainer.optimizer)
    post["_payload_bytes"] = torch.tensor(stats.payload_bytes)
    post["_sent_bytes"] = torch.tensor(stats.sent_bytes)
    post["_replicate_bytes"] = torch.tensor(stats.replicate_bytes)
    replicas = trainer.place.replicate_pg()
    if replicas is not None:  # HSDP: every replica of a shard holds it bit-identically
        mine = torch.cat([p.to_local().reshape(-1) for p in trainer.model.parameters()])
        copies = [torch.empty_like(mine) for _ in range(replicas.size())]
        torch.distributed.all_gather(copies, mine, group=replicas)
        agree = torch.tensor([float(all(torch.equal(c, copies[0]) for c in copies))])
        torch.distributed.all_reduce(agree, op=torch.distributed.ReduceOp.MIN)
        post["_replicas_agree"] = agree
    save_from_group_leader(post, f"{out}/post_r{r}_g{g}.pt", k)

meta = build_model(cfg.model, trainer.data.corpus.vocab_size, seed=7, meta=True)
parallelize(meta, trainer.place.sharding_mesh())
materialize(meta, trainer.device, seed=7)
state = full_state(meta)
state["_inv_freq"] = meta.model.rotary_emb.inv_freq.clone()
x, y = next(trainer.data.batches)
state["_loss"] = torch.nn.functional.cross_entropy(
    meta(input_ids=x).logits.reshape(-1, meta.config.vocab_size), y.reshape(-1)
).detach()
save_from_group_leader(state, f"{out}/meta_g{g}.pt", k)
trainer.close(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
