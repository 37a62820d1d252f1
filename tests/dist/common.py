"""Helpers for the scripts that tests run under torchrun (they save tensors; pytest asserts)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor, gathered over the group's sharding mesh only.

    Independent of the outer sync's own code path: uses DTensor.full_tensor().
    """
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def full_moments(model, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            t = optimizer.state[p][key]
            out[f"{name}.{key}"] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def save_from_group_leader(obj, path: str, group_size: int) -> None:
    """The first rank of each group writes (every group has its own copy of the model)."""
    if dist.get_rank() % group_size == 0:
        torch.save(obj, path)
