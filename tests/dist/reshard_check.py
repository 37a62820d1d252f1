"""Under torchrun: load a group checkpoint saved by another number of ranks, save it again.

argv: CONFIG_JSON DATA_DIR RUN_DIR ROUND OUT_ROOT
Loads RUN_DIR's checkpoint of ROUND for this rank's group (whatever K the world has now) and
saves the loaded state under OUT_ROOT/group_G; the test compares the two checkpoints.
"""

import sys

from flower_shard.runtime import checkpoint as C
from flower_shard.config import TrainConfig
from flower_shard.runtime.trainer import GroupTrainer

cfg_path, data_dir, run_dir, rnd, out_root = sys.argv[1:6]
trainer = GroupTrainer(TrainConfig.from_json(cfg_path), data_dir)
source = C.round_dir(trainer.checkpoint_root(run_dir), int(rnd))
assert C.verify(source) is None, C.verify(source)
loaded = trainer.load_checkpoint(source, trainer.outer)
trainer.save_checkpoint(trainer.checkpoint_root(out_root), loaded, trainer.outer)
trainer.close(clean=True)
