"""The inner optimizer and its learning-rate schedule: AdamW, linear warm-up, cosine decay."""

from __future__ import annotations

import math

import torch

from flower_shard.config import TrainConfig


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


class LRSchedule:
    """The inner optimizer's LR over the run: :func:`warmup_cosine` of a position in steps.

    The position is the optimizer's step count, or, for time-budgeted rounds, where the run is
    by the clock (:attr:`position`, in steps of the nominal ``total_steps``): then a fast and a
    slow group decay alike instead of each by its own step count. Its state is the wrapped
    ``LambdaLR``'s (what checkpoints keep).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig):
        warmup = int(cfg.warmup_frac * cfg.total_steps)
        self.position: float | None = None
        """Time-budgeted rounds: the run's position in steps; None: the optimizer's step."""
        # A closure, not a bound method: LambdaLR's state_dict stores callable objects' state.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(
                step if self.position is None else int(self.position),
                cfg.total_steps,
                warmup,
                cfg.min_lr_ratio,
            ),
        )

    def step(self) -> None:
        self.scheduler.step()

    @property
    def lr(self) -> float:
        """The LR of the last step."""
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """The inner optimizer: AdamW (betas 0.9 / 0.95, eps 1e-8) with the run's LR and decay."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=cfg.weight_decay,
    )
