"""Under torchrun: group A's cross-group sync is abandoned while it waits for a peer group.

argv: MODE OUT_DIR. Ranks 0-1 are group A, which syncs under a rendezvous store that rank 0
hosts (the ServerApp's, in a real run) with a timeout of 120 s; 2 s in, rank 0 raises the
abandon flag of the command A runs. ``rendezvous`` (2 ranks): the peer group never comes.
``allreduce`` (4 ranks): group B (ranks 2-3) joins the rendezvous, then never all-reduces.
Group A's ranks save OUT/a{rank}.pt: the outcome, the seconds it took, the weights before and
after.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from flower_shard.flower.group.abandon import Abandonment
from flower_shard.runtime.commit import sync_or_rollback
from flower_shard.runtime.cross_group import CrossGroup, Membership
from flower_shard.runtime.outer_sync import OuterSync

COMMAND, TIMEOUT_S = 7, 120
mode, out = sys.argv[1:3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
groups = [dist.new_group([0, 1]), dist.new_group([2, 3]) if world == 4 else None]
if rank == 0:
    rendezvous = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    box = [rendezvous.port]
else:
    box = [None]
dist.broadcast_object_list(box, src=0)
address = f"127.0.0.1:{box[0]}"
abandonment = Abandonment()

torch.manual_seed(rank)
model = torch.nn.Linear(16, 8)
outer = OuterSync(model, torch.optim.SGD(model.parameters(), lr=0.1))
cross = CrossGroup(address, shard=rank % 2, device=torch.device("cpu"), timeout_s=TIMEOUT_S)
if rank < 2:
    if rank == 0:
        threading.Timer(2.0, abandonment.raise_for, args=(COMMAND,)).start()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    outcome = sync_or_rollback(
        outer,
        cross,
        Membership("dead-run/round3", 0, 2),
        vote_pg=groups[0],
        abandoned=abandonment.checker(COMMAND),
    )
    seconds = time.perf_counter() - start
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(
        {"failure": outcome.failure, "seconds": seconds, "before": before, "after": after},
        f"{out}/a{rank}.pt",
    )
else:  # group B: in the rendezvous, then never in the all-reduce
    peer = cross.connect(Membership("dead-run/round3", 1, 2))  # kept: a dropped group closes
dist.barrier()
os._exit(0)  # an abandoned collective's threads would hold up an orderly exit until timeout
