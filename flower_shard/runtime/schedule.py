"""Learning-rate schedule of the inner optimizer: linear warm-up, then cosine decay."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based).

    Rises linearly from 1/warmup to 1 over ``warmup_steps``, then follows a half cosine from 1
    down to ``min_ratio`` at ``total_steps - 1``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
