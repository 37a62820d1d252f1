"""The outer optimizer: the math that turns the groups' average into the next global weights.

It works on one flat float32 tensor, so the same code runs on a rank's local shards (the
collective transport, :class:`~flower_shard.runtime.outer_sync.OuterSync`) and on full arrays on
the Flower server (the flower transport).
"""

from __future__ import annotations

import torch
from torch import nn

from flower_shard.config.choices import FEDAVG, NESTEROV, OUTER_OPTIMIZERS


def pseudo_gradient(global_weights: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """DiLoCo's outer gradient: how far the groups' mean moved from the last global weights."""
    return global_weights - mean


class OuterOptimizer:
    """Turns the groups' average into the next global weights.

    ``fedavg``: the average replaces the weights (no state).

    ``nesterov`` (DiLoCo): keeps the last global weights ``w``; with the groups' mean ``m``,
    the pseudo-gradient ``w - m`` is fed to ``torch.optim.SGD(lr, momentum, nesterov=True)``
    stepping ``w``. With lr 1 and momentum 0 it reduces to fedavg (up to rounding).

    The optimizer never fails half-way on its own: a step is plain tensor arithmetic. A caller
    that must undo a step (a cross-group sync that failed on another rank) restores
    :meth:`buffers` from a copy.

    Parameters
    ----------
    initial
        Flat float32 tensor of the weights at the start (the first global weights). Copied.
    kind
        ``fedavg`` or ``nesterov``.
    lr, momentum
        Outer learning rate and momentum (nesterov only).
    track_weights
        fedavg: keep the global weights too, so that :meth:`apply` can take a pseudo-gradient
        (nesterov always keeps them).
    """

    def __init__(
        self,
        initial: torch.Tensor,
        kind: str = FEDAVG,
        lr: float = 0.7,
        momentum: float = 0.9,
        track_weights: bool = False,
    ):
        if kind not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"outer optimizer {kind!r} is unknown; choose one of {', '.join(OUTER_OPTIMIZERS)}"
            )
        self.kind = kind
        self._sgd = None
        self.weights = None
        if kind == NESTEROV:
            self.weights = nn.Parameter(initial.detach().clone().float())
            # torch refuses nesterov without momentum; momentum 0 is plain SGD (the same update).
            self._sgd = torch.optim.SGD(
                [self.weights], lr=lr, momentum=momentum, nesterov=momentum > 0
            )
        elif track_weights:  # fedavg from pseudo-gradients needs the last global weights
            self.weights = initial.detach().clone().float()

    def step(self, mean: torch.Tensor) -> torch.Tensor:
        """Return the new global weights given the groups' mean (a flat tensor, not modified)."""
        if self._sgd is None:
            if self.weights is not None:
                self.weights.copy_(mean)
            return mean
        return self.apply(pseudo_gradient(self.weights.detach(), mean))

    @torch.no_grad()
    def apply(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """Return the new global weights given the groups' mean pseudo-gradient ``w - mean``
        (what a compressed exchange delivers); needs the tracked weights.

        fedavg: ``w - pseudo_grad``; nesterov: an SGD step with ``pseudo_grad`` as gradient.
        """
        if self.weights is None:
            raise RuntimeError("OuterOptimizer(track_weights=True) is needed to apply deltas")
        if self._sgd is None:
            self.weights.sub_(pseudo_grad)
            return self.weights
        self.weights.grad = pseudo_grad
        self._sgd.step()
        self.weights.grad = None
        return self.weights.detach()

    @torch.no_grad()
    def step_part(self, mean: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """:meth:`step` for the values ``[start, stop)`` of the flat weights alone (one fragment
        of a fragmented sync, :mod:`flower_shard.runtime.streaming_sync`); the rest of the state
        is untouched."""
        if self._sgd is None:
            if self.weights is not None:
                self.weights[start:stop].copy_(mean)
            return mean
        return self.apply_part(pseudo_gradient(self.weights.data[start:stop], mean), start, stop)

    @torch.no_grad()
    def apply_part(self, pseudo_grad: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """:meth:`apply` for the values ``[start, stop)`` alone; returns that slice of the new
        weights (a view). Nesterov runs torch's SGD update (dampening 0) on the slice."""
        if self.weights is None:
            raise RuntimeError("OuterOptimizer(track_weights=True) is needed to apply deltas")
        weights = self.weights.data[start:stop]
        if self._sgd is None:
            return weights.sub_(pseudo_grad)
        group = self._sgd.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        grad = pseudo_grad
        if momentum > 0:
            buf = self.buffers()["momentum"][start:stop]
            buf.mul_(momentum).add_(grad)
            grad = grad.add(buf, alpha=momentum)  # nesterov
        return weights.add_(grad, alpha=-lr)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The flat state tensors themselves (global weights, nesterov's momentum), to load in
        place; empty for fedavg without tracked weights.

        Before the first step the momentum is created as zeros, which gives the same first
        update as torch's lazily created buffer (a copy of the first gradient).
        """
        if self.weights is None:
            return {}
        if self._sgd is None:
            return {"weights": self.weights}
        state = self._sgd.state[self.weights]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(self.weights.data)
        return {"weights": self.weights.data, "momentum": state["momentum_buffer"]}

    def state_dict(self) -> dict:
        if self.weights is None:
            return {}
        out = {"weights": self.weights.detach().clone()}
        if self._sgd is not None:
            out["sgd"] = self._sgd.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if self.weights is not None:
            with torch.no_grad():
                self.weights.copy_(state["weights"])
        if self._sgd is not None:
            self._sgd.load_state_dict(state["sgd"])
