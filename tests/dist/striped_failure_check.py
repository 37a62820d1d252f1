"""Under torchrun, 4 ranks = 2 groups x 2 HSDP replicas: one stripe's cross-group all-reduce
fails (injected on replica 1 of both groups, which pair with each other); the sync must return
on replica 0, raise on replica 1, and hang nowhere (the replicas' all-gather still completes).

argv: OUT_DIR. Writes result_RANK.txt: "ok" or "raised: REASON".
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from flower_shard.runtime.outer_sync import OuterSync
from flower_shard.runtime.distributed import exit_now, shutdown


class FailingAllreduce:
    """A real process group whose all-reduce fails, as a dead peer makes it do."""

    def __init__(self, pg):
        self.pg = pg

    def size(self) -> int:
        return self.pg.size()

    def rank(self) -> int:
        return self.pg.rank()

    def allgather(self, *args):
        return self.pg.allgather(*args)

    def allreduce(self, *args):
        raise RuntimeError("injected: the peer group is gone")


out = sys.argv[1]
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("group", "replicate"))
replica = mesh.get_local_rank("replicate")
torch.manual_seed(0)  # the replicas of a group hold the same weights
model = nn.Linear(7, 5)
cross = mesh.get_group("group")
sync = OuterSync(
    model,
    torch.optim.AdamW(model.parameters()),
    FailingAllreduce(cross) if replica == 1 else cross,
    replicate_pg=mesh.get_group("replicate"),
)
try:
    sync.sync()
    result = "ok"
except RuntimeError as exc:
    result = f"raised: {exc}"
with open(f"{out}/result_{dist.get_rank()}.txt", "w") as fh:
    fh.write(result)
shutdown(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
