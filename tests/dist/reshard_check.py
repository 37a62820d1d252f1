"""Under torchrun: load a group checkpoint saved by another number of ranks, save it again.

argv: CONFIG_JSON DATA_DIR RUN_DIR ROUND OUT_ROOT
Loads RUN_DIR's checkpoint of ROUND for this rank's group (whatever K the world has now) and
saves the loaded state under OUT_ROOT/group_G; the test compares the two checkpoints.
"""

import sys

from flower_shard.config import TrainConfig
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime.group_checkpoint import checkpoint_root
from flower_shard.runtime.trainer import build_job_trainer
from flower_shard.runtime.distributed import exit_now

cfg_path, data_dir, run_dir, rnd, out_root = sys.argv[1:6]
trainer = build_job_trainer(TrainConfig.from_json(cfg_path), data_dir)
group = trainer.place.group
source = C.round_dir(checkpoint_root(run_dir, group), int(rnd))
assert C.verify(source) is None, C.verify(source)
loaded = trainer.checkpointer.load(source)
trainer.checkpointer.save(checkpoint_root(out_root, group), loaded.round)
trainer.close(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
