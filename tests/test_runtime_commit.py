"""The cross-group sync is all-or-nothing for a group, on real gloo process groups (no Flower).

tests/dist/commit_vote_check.py runs 2 groups x 2 FSDP shards that sync through the runtime's
CrossGroup and vote over their own group (sync_or_rollback). In round 1 one shard's peers never
meet: the other shard's sync succeeds, yet every rank of both groups must report the failure
and hold exactly what it held before (weights, synced AdamW moments, outer state). In round 2
everyone meets and the sync commits the exact mean.
"""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun

from flower_shard.config import TrainConfig
from flower_shard.runtime.commit import ANOTHER_RANK_FAILED

MOMENTS = (".exp_avg", ".exp_avg_sq")


def rank_of(group: int, shard: int) -> int:
    return group * 2 + shard  # the script's (group, shard) mesh is row-major


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def nesterov_reference(weights: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """One outer step written out with torch's own SGD: w <- SGD_nesterov(w, grad = w - mean)."""
    cfg = TrainConfig()
    w = torch.nn.Parameter(weights.clone())
    sgd = torch.optim.SGD([w], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    w.grad = weights - mean
    sgd.step()
    return w.detach()


@pytest.mark.parametrize("outer", ["fedavg", "nesterov"])
def test_a_failed_shard_rolls_back_both_groups_and_a_full_round_commits_the_mean(tmp_path, outer):
    torchrun("commit_vote_check.py", 4, outer, tmp_path, timeout=240)
    ranks = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=False) for r in range(4)]

    # Round 1: shard 1's peers never met; shard 0 synced, then followed its group's vote.
    for r, res in enumerate(ranks):
        one = res["round1"]
        assert not one["committed"], f"rank {r} committed a sync its group did not finish"
        if res["shard"] == 1:
            assert one["failure"] and one["failure"] != ANOTHER_RANK_FAILED, one["failure"]
        else:
            assert one["failure"] == ANOTHER_RANK_FAILED, one["failure"]
        assert_same(one["after"], one["before"], f"rank {r} after the rolled-back round")
        if outer == "nesterov":  # the outer state is part of what was restored
            assert {"outer.weights", "outer.momentum"} <= one["before"].keys()

    # Round 2: every rank commits; both groups hold the exact mean of what they held before.
    for shard in (0, 1):
        a, b = ranks[rank_of(0, shard)], ranks[rank_of(1, shard)]
        assert a["round2"]["committed"] and b["round2"]["committed"]
        pre_a, pre_b = a["round2"]["before"], b["round2"]["before"]
        names = a["names"]
        assert any(not torch.equal(pre_a[n], pre_b[n]) for n in names)  # they trained apart
        mean = {k: (pre_a[k] + pre_b[k]) / 2 for k in pre_a if not k.startswith("outer.")}
        for res in (a, b):
            after = res["round2"]["after"]
            for k in mean:
                if k.endswith(MOMENTS) or outer == "fedavg":
                    assert torch.equal(after[k], mean[k]), f"shard {shard}: {k}"
            if outer == "nesterov":
                flat_mean = torch.cat([mean[n].reshape(-1) for n in names])
                expected = nesterov_reference(pre_a["outer.weights"], flat_mean)
                got = torch.cat([after[n].reshape(-1) for n in names])
                assert torch.equal(got, expected), f"shard {shard}: not the outer step"
                assert not torch.equal(got, flat_mean)
