"""The language-model loss and the held-out evaluation, used by the groups and the ServerApp.

One function computes the held-out loss of a model on a set of blocks, whether the model is
sharded over a group's ranks (each rank passes its share of the blocks and the number of
forwards every rank must run, since FSDP gathers inside them) or whole on the ServerApp (the
flower transport evaluates the global model there). Losses are summed in float64 in a fixed
order, so the same model on the same blocks gives the same value in both places.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Next-token cross-entropy of a causal LM, computed in float32."""
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction
    )


@torch.no_grad()
def loss_sums(
    model,
    blocks: np.ndarray,
    batch_size: int,
    device: torch.device | str = "cpu",
    forwards: int | None = None,
) -> torch.Tensor:
    """``[sum of token losses, number of tokens]`` (float64) of ``model`` on ``blocks``.

    Parameters
    ----------
    model
        A causal LM in eval mode (whole, or this rank's FSDP shards of it).
    blocks
        ``(n, seq_len + 1)`` token blocks: inputs are ``[:, :-1]``, targets ``[:, 1:]``.
    batch_size
        Blocks per forward.
    device
        Where the model computes.
    forwards
        Run exactly this many forwards, padding short or missing batches with rows whose loss
        is left out (every rank of an FSDP group must run the same number). None: one forward
        per ``batch_size`` blocks, no padding.
    """
    model.eval()
    seq_len = blocks.shape[1] - 1
    total = torch.zeros(2, dtype=torch.float64, device=device)
    rows_all = torch.from_numpy(np.asarray(blocks).astype("int64"))
    n = math.ceil(len(rows_all) / batch_size) if forwards is None else forwards
    for b in range(n):
        rows = rows_all[b * batch_size : (b + 1) * batch_size]
        real = len(rows)
        if forwards is not None and real < batch_size:  # the padding's values do not matter
            pad = torch.zeros(batch_size - real, seq_len + 1, dtype=torch.int64)
            rows = torch.cat([rows, pad])
        rows = rows.to(device)
        losses = lm_loss(model, rows[:, :-1], rows[:, 1:], reduction="none")
        losses = losses.view(len(rows), seq_len)[:real]
        total[0] += losses.double().sum()
        total[1] += losses.numel()
    return total


def perplexity(mean_loss: float) -> float:
    """exp(loss), capped so that a diverged run reports a large number instead of overflowing."""
    return math.exp(min(mean_loss, 700.0))
