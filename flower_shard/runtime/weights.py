"""A sharded model's full weights: gathered to rank 0, loaded from rank 0, written to a file.

Each group gathers over its own sharding mesh (FSDP2's DTensors), so with several groups in one
torch job every group's ranks take part and rank 0 ends up with group 0's copy. Loading
broadcasts from the world's rank 0: use it where the world is one group (a Flower group).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank (a collective inside each group): the full weights, on CPU, on rank 0; empty
    elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return state if dist.get_rank() == 0 else {}


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every rank: load full weights that rank 0 holds (``state`` is ignored elsewhere) into the
    sharded ``model``, broadcast from rank 0 over the world."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model,
        state if dist.get_rank() == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``tensors`` to ``path`` atomically (a temporary name, then a rename), so a crash
    never leaves a half-written file under the real name."""
    from safetensors.torch import save_file

    out, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        # Tied weights (GPT-2's embedding and LM head) share storage, which safetensors
        # refuses: write a copy; loading ties them again.
        if tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(out, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
