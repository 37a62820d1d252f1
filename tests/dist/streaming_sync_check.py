"""Under torchrun: a fragmented / overlapped outer sync; every sync event's weights saved.

argv: CONFIG_JSON DATA_DIR FRAGMENTS MODE (``overlap`` or ``blocking``) OUT_DIR.
Rank 0 of each group saves OUT/events_g{g}.pt: per sync event (round, fragment, its parameter
names) the group's full weights before and after, then the drain's, and the initial ones; the
bytes each round's syncs counted (payload, sent across groups, sent to replicas); with G = 1
also the final weights of a second model trained on the same batches with no outer sync at all
(``plain``).
"""

import sys
from pathlib import Path

import torch.distributed as dist
from common import full_state, save_from_group_leader

from flower_shard.config import TrainConfig
from flower_shard.runtime.data_part import DataPart
from flower_shard.runtime.group_trainer import GroupTrainer
from flower_shard.runtime.outer_sync import build_outer_sync
from flower_shard.runtime.streaming_sync import StreamingSync
from flower_shard.runtime.trainer import build_job_trainer
from flower_shard.runtime.distributed import exit_now

cfg_path, data_dir, fragments, mode, out = sys.argv[1:6]
cfg = TrainConfig.from_json(cfg_path)
trainer = build_job_trainer(cfg, data_dir)
place = trainer.place
pg = place.outer_pg()
if pg is None:  # G = 1: every rank syncs with itself alone
    pg, _ = dist.new_subgroups(group_size=1)
sync = build_outer_sync(
    cfg, trainer.model, trainer.optimizer, group_pg=pg, replicate_pg=place.replicate_pg()
)
streaming = StreamingSync(
    sync, trainer.model, int(fragments), overlap=mode != "blocking", pace=mode == "paced"
)
T = cfg.local_steps
events, unsent = [], []
init = full_state(trainer.model)


def between(done: int) -> None:
    due = [f for f in streaming.fragments if streaming.due(f, T) == done]
    before = full_state(trainer.model) if due else None
    streaming.after_step(done, T)
    unsent.append(streaming.unsent_pieces())
    if due:
        after = full_state(trainer.model)
        for f in due:
            events.append(
                dict(round=r, fragment=f.index, names=f.names, before=before, after=after)
            )


stats = []
for r in range(cfg.rounds):
    trainer.train_steps(T, between=between)
    stats.append(streaming.end_round())
before = full_state(trainer.model)
streaming.drain()
events.append(dict(round=cfg.rounds, fragment=None, before=before, after=full_state(trainer.model)))
result = {
    "init": init,
    "events": events,
    "unsent": unsent,
    "fragments": [f.names for f in streaming.fragments],
    "stats": [(s.payload_bytes, s.sent_bytes, s.replicate_bytes) for s in stats],
}
if cfg.groups == 1:
    plain = GroupTrainer(cfg, place, DataPart.load(Path(data_dir), cfg, place))
    plain.train_steps(T * cfg.rounds)
    result["plain"] = full_state(plain.model)
save_from_group_leader(result, f"{out}/events_g{place.group}.pt", place.group_size)
trainer.close(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
