"""Apply FSDP2 / HSDP to a decoder-only transformer, torchtitan-style.

Order matters: each decoder block is wrapped first (one all-gather / reduce-scatter unit per
block, so communication of block i+1 overlaps compute of block i), then the root, which takes
the remaining parameters (embeddings, final norm, LM head). A 1-D mesh gives FSDP; a 2-D
``(replicate, shard)`` mesh gives HSDP (shard inside, all-reduce across replicas).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (decoder layers) in order, whatever the model's class.

    ``transformers`` names the blocks that must stay whole in ``_no_split_modules``
    (``LlamaDecoderLayer``, ``GPT2Block``, ...); the outermost modules of those classes are
    the layers. Without that attribute: the largest ``nn.ModuleList`` whose items all share one
    class (``model.layers``, ``transformer.h``, ...). Empty if neither finds anything.
    """
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    layers: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ not in wanted:
            continue
        # A block inside an already chosen block belongs to that one's FSDP unit.
        if not any(name.startswith(f"{outer}.") for outer, _ in layers):
            layers.append((name, module))
    if layers:
        return [module for _, module in layers]
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1
    ]
    return list(max(candidates, key=len)) if candidates else []


def parallelize(
    model: nn.Module, mesh, *, bf16: bool = False, reshard_after_forward: bool = True
) -> nn.Module:
    """Shard ``model`` over ``mesh`` in place and return it.

    Parameters
    ----------
    model
        A ``transformers`` causal LM, e.g. ``LlamaForCausalLM`` (real or on the meta device);
        its decoder layers are found by :func:`decoder_layers`.
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
    # Without layers the root alone is one unit: correct, only without the overlap.
    layers = decoder_layers(model)
    for i, block in enumerate(layers):
        # The last block is gathered again at once by backward: keep it.
        last = i == len(layers) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
