"""Accounting of the intra-group tier: the bytes and time of FSDP2's collectives, as they run.

FSDP2 lets a module replace its all-gather and reduce-scatter (``set_custom_all_gather``,
``set_custom_reduce_scatter``, public since torch 2.8). :func:`install` gives every FSDP module
of a model a pair that issues the very same collectives (``all_gather_single``,
``reduce_scatter_single``, as FSDP2's defaults: the math is unchanged bit for bit) and records
each call: its payload, its group size and its duration. HSDP's all-reduce of the gradient
shards across replicas is not replaceable; FSDP2 calls the module's all-reduce hook right after
it, so the hook closes its timing and the size of the reduce-scatter's output gives its bytes.

Bytes are what one rank sends, derived from the payloads FSDP2 really moved (padding, mixed
precision, modules gathered once or twice per step included) and the algorithm of the backend,
by the cost model's own :func:`flower_shard.planning.costmodel.sent_bytes` (gloo runs a
reduce-scatter as an all-reduce: twice a ring's bytes).

Time: on CPU (gloo) the collectives block the rank, so the time is spent waiting in them (part
of the step time). On CUDA they run on FSDP's communication streams, overlapped with compute;
CUDA events around each give the time they ran on those streams, read when the counters are
taken (one synchronize per round).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from flower_shard.planning.costmodel import sent_bytes

KINDS = ("allgather", "reduce_scatter", "replicate_allreduce")


@dataclass
class IntraCommStats:
    """Counters since the last :meth:`take`, per kind of collective."""

    backend: str
    cuda: bool
    calls: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    seconds: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    _events: list = field(default_factory=list)
    _open_allreduce: tuple | None = None

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()  # on the current stream: FSDP's communication stream at this point
            return ev
        return time.perf_counter()

    def stop(self, kind: str, started, payload: int, n: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += sent_bytes(kind, payload, n, self.backend)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((kind, started, ev))
        else:
            self.seconds[kind] += time.perf_counter() - started

    def open_allreduce(self, payload: int) -> None:
        """HSDP: FSDP2 all-reduces ``payload`` bytes over the replicas next; timed until
        :meth:`close_allreduce`, which FSDP2 calls through the module's all-reduce hook."""
        self._open_allreduce = (self.start(), payload)

    def close_allreduce(self, replicate: int) -> None:
        if self._open_allreduce is not None:
            started, payload = self._open_allreduce
            self._open_allreduce = None
            self.stop("replicate_allreduce", started, payload, replicate)

    def take(self) -> dict:
        """``{kind: {"calls", "bytes", "seconds"}}`` since the last call, and reset."""
        if self._events:
            torch.cuda.synchronize()
            for kind, a, b in self._events:
                self.seconds[kind] += a.elapsed_time(b) / 1e3
            self._events.clear()
        out = {
            k: {"calls": self.calls[k], "bytes": self.bytes[k], "seconds": self.seconds[k]}
            for k in KINDS
        }
        self.calls = dict.fromkeys(KINDS, 0)
        self.bytes = dict.fromkeys(KINDS, 0.0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        return out


# Duck-typed to FSDP2's AllGather / ReduceScatter interfaces (allocate + __call__), whose base
# classes torch does not export.
class _CountedAllGather:
    def __init__(self, stats: IntraCommStats):
        self.stats = stats

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        started = self.stats.start()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        if work is not None:  # FSDP2 waits on it later; count the bytes, time until issued
            work.wait()
        payload = input_tensor.numel() * input_tensor.element_size()
        self.stats.stop("allgather", started, payload, group.size())
        return None


class _CountedReduceScatter:
    def __init__(self, stats: IntraCommStats, replicate: int):
        self.stats, self.replicate = stats, replicate

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        started = self.stats.start()
        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        if work is not None:
            work.wait()
        payload = input_tensor.numel() * input_tensor.element_size()
        self.stats.stop("reduce_scatter", started, payload, group.size())
        if self.replicate > 1:  # HSDP's all-reduce of this output follows; the hook closes it
            self.stats.open_allreduce(output_tensor.numel() * output_tensor.element_size())
        return None


def install(model: nn.Module, replicate: int, device: torch.device) -> IntraCommStats:
    """Count every FSDP module's collectives in ``model``; returns the live counters."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    stats = IntraCommStats(backend=backend, cuda=device.type == "cuda")

    def after_allreduce(_reduce_output: torch.Tensor) -> None:
        stats.close_allreduce(replicate)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_CountedAllGather(stats))
            module.set_custom_reduce_scatter(_CountedReduceScatter(stats, replicate))
            if replicate > 1:
                module.set_all_reduce_hook(after_allreduce)
    return stats
