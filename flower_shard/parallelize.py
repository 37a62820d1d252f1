"""Apply FSDP2 / HSDP to a Llama decoder, torchtitan-style.

Order matters: each decoder block is wrapped first (one all-gather / reduce-scatter unit per
block, so communication of block i+1 overlaps compute of block i), then the root, which takes
the remaining parameters (embeddings, final norm, LM head). A 1-D mesh gives FSDP; a 2-D
``(replicate, shard)`` mesh gives HSDP (shard inside, all-reduce across replicas).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def parallelize(
    model: nn.Module, mesh, *, bf16: bool = False, reshard_after_forward: bool = True
) -> nn.Module:
    """Shard ``model`` over ``mesh`` in place and return it.

    Parameters
    ----------
    model
        A ``LlamaForCausalLM`` (real or on the meta device).
    mesh
        The group's sharding mesh: ``mesh["shard"]`` (FSDP) or ``mesh["replicate", "shard"]``
        (HSDP).
    bf16
        Compute in bfloat16; the sharded parameters and the gradient reduction stay float32.
    reshard_after_forward
        Free the gathered parameters after forward (ZeRO-3); False keeps them until backward.
    """
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    layers = list(model.model.layers)
    for i, block in enumerate(layers):
        # The last block is gathered again at once by backward: keep it.
        last = i == len(layers) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
