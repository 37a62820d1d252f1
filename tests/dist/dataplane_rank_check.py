"""Under torchrun: one group of the tiny model (FSDP, or HSDP when argv says so) pulls the global
model from real aggregators, moves its weights, pushes its pseudo-gradient, and pulls again.

argv: ADDRESSES SECRET ROUND SHARDING FOLLOW OUT_DIR (FOLLOW ``follow``: the rank follows the round
while it pushes, the pipelined commit). Writes, from rank 0, what the group held after
each pull (full tensors, gathered with DTensor.full_tensor) and what it pushed.
"""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from common import full_state

from flower_shard.dataplane import tickets
from flower_shard.dataplane.client import RankLink
from flower_shard.dataplane.layout import Layout
from flower_shard.dataplane.rank import RankExchange
from flower_shard.runtime.models import build_model
from flower_shard.runtime.parallelize import parallelize
from flower_shard.runtime.topology import Topology
from flower_shard.runtime.distributed import exit_now, shutdown

addresses, secret, first, sharding, follow, out = sys.argv[1:7]
first = int(first)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
world = dist.get_world_size()
replicate = 2 if sharding == "hsdp" else 1
topo = Topology(world, 1, sharding, replicate)
mesh = topo.build_mesh("cpu")
model = build_model("tiny", 257, seed=1, max_positions=32)  # not the aggregators' weights
parallelize(model, topo.sharding_mesh(mesh))
layout = Layout.from_json(json.load(open(f"{out}/layout.json")))
ex = RankExchange(model, layout, "none", 2048, True, topo.replicate_group(mesh))


def link(rnd):
    token = tickets.group_token(secret, "run-1", rnd, 0)
    t = tickets.Ticket("run-1", rnd, 0, token, tuple(addresses.split(",")), False)
    return RankLink(t, dist.get_rank())


def wait_for(name):
    import os
    import time

    while not os.path.exists(f"{out}/{name}"):
        time.sleep(0.1)


# The test opens round `first` before starting us, and `first + 1` once we said "pushed"
# (HSDP: `first + 2` once we said "pushed2").
mode = ex.pull(link(first))
pulled = full_state(model)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(0.5)  # a deterministic "training": the pseudo-gradient is half the weights
moved = full_state(model)
if follow == "follow":
    ex.follow(link(first))
ex.push(link(first), weight=100.0)
dist.barrier()
if dist.get_rank() == 0:
    torch.save({"mode": mode, "pulled": pulled, "moved": moved}, f"{out}/first.pt")
    open(f"{out}/pushed", "w").close()
wait_for("next")  # the next round is open
mode = ex.pull(link(first + 1))
if dist.get_rank() == 0:
    torch.save({"mode": mode, "pulled": full_state(model)}, f"{out}/second.pt")
else:
    full_state(model)  # every rank joins the gather
if follow == "follow":  # the overlapped round's steps (flower_shard/flower/group/overlap.py)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    ex.snapshot()  # s: what goes out
    sent = full_state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # trains on before the push: the push must read s, not the shards
    trained = full_state(model)
    ex.follow(link(first + 1))
    ex.push(link(first + 1), weight=100.0, snapshot=True)
    dist.barrier()
    if dist.get_rank() == 0:
        open(f"{out}/pushed2", "w").close()
    wait_for("next2")
    mode = ex.confirm(link(first + 2))  # the view to the committed model, not the shards
    ex.rebase()  # every replica: theta += X - s
    rebased = full_state(model)
    # A failure (flower_shard/flower/group/overlap.py resets): a follower still waiting for a
    # round nobody uploads to is cut off, not waited for (the aggregators would wait 600 s).
    import time

    ex.follow(link(first + 2))
    began = time.monotonic()
    ex.forget()
    cut_s = time.monotonic() - began
    if dist.get_rank() in (0, world - 1):  # replica 0 (it pulled) and the last replica
        state = {"mode": mode, "sent": sent, "trained": trained, "rebased": rebased}
        state |= {"cut_s": cut_s, "have_round": ex.have_round}
        torch.save(state, f"{out}/third_{dist.get_rank()}.pt")
shutdown(clean=True)
exit_now()  # see exit_now: no finalization race with gloo's threads
