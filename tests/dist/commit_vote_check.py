"""Under torchrun, 4 ranks = 2 groups x 2 FSDP shards: the all-or-nothing cross-group sync.

The two groups sync as Flower groups in separate jobs do: each rank through its own
CrossGroup (a TCPStore that rank 0 hosts, as the ServerApp does), voting over its group's own
process group. Round 1: shard 1 of group 1 goes to another rendezvous, so shard 1's peers never
meet (both time out) while shard 0's sync succeeds. Round 2: everyone meets.

argv: OUTER OUT_DIR. Writes OUT/rank_R.pt: the group and shard, each round's outcome, and this
rank's local shards of the weights, the AdamW moments and the outer state before and after
each round.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from flower_shard.config import TrainConfig
from flower_shard.runtime.commit import sync_or_rollback
from flower_shard.runtime.cross_group import CrossGroup, Membership
from flower_shard.runtime.outer_sync import build_outer_sync
from flower_shard.runtime.distributed import exit_now, shutdown

TIMEOUT_S = 3.0

outer_kind, out = sys.argv[1:3]
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("group", "shard"))
group, shard = mesh.get_local_rank("group"), mesh.get_local_rank("shard")

torch.manual_seed(0)  # every group starts from the same weights
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
cfg = TrainConfig(outer=outer_kind, sync_optimizer_state=True)
outer = build_outer_sync(cfg, model, optimizer)

data = torch.Generator().manual_seed(100 + group)  # the groups train apart
for _ in range(3):
    model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def local_state() -> dict[str, torch.Tensor]:
    """Copies of this rank's shards: weights, AdamW moments, the outer optimizer's state."""
    state = {}
    for name, p in model.named_parameters():
        state[name] = p.to_local().detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{name}.{key}"] = optimizer.state[p][key].to_local().clone()
    for key, t in outer.flat_state().items():
        state[f"outer.{key}"] = t.clone()
    return state


store = None
port = [None]
if dist.get_rank() == 0:  # the rendezvous the ServerApp would host
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = [store.port]
dist.broadcast_object_list(port, src=0)
cross = CrossGroup(f"127.0.0.1:{port[0]}", shard, torch.device("cpu"), TIMEOUT_S)
vote = mesh.get_group("shard")  # the group's own ranks

result = {"group": group, "shard": shard, "names": [n for n, _ in model.named_parameters()]}
for rnd, prefix in ((1, "round-1"), (2, "round-2")):
    if rnd == 1 and (group, shard) == (1, 1):
        prefix = "round-1-elsewhere"  # its peer in group 0 waits for it in vain
    before = local_state()
    outcome = sync_or_rollback(outer, cross, Membership(prefix, group, 2), vote_pg=vote)
    result[f"round{rnd}"] = {
        "committed": outcome.committed,
        "failure": outcome.failure,
        "before": before,
        "after": local_state(),
    }
torch.save(result, f"{out}/rank_{dist.get_rank()}.pt")
shutdown(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
