"""Who owns what: parameters across aggregators, and element ranges across a group's ranks.

Parameters are numbered in sorted-name order (every party sorts the same names). Each is owned
whole by one of A aggregators, chosen by the longest-processing-time rule (largest first onto
the least loaded aggregator; ties by name and index), so each aggregator holds about 1/A of
the model and a chunk never spans two of them. A rank holds, of each parameter, the rows its
FSDP2 shard holds (``Shard(0)``: contiguous rows, so contiguous flat elements): the element
range ``[start, stop)`` it uploads and downloads; groups with different K cut the same
parameter differently, which the aggregators do not mind (chunks are keyed by element range).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Param:
    index: int
    name: str
    shape: tuple[int, ...]
    owner: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """The model's parameters, numbered, with their owning aggregator."""

    params: tuple[Param, ...]
    aggregators: int

    @classmethod
    def build(cls, shapes: Mapping[str, Sequence[int]], aggregators: int) -> Layout:
        if aggregators < 1:
            raise ValueError(f"aggregators must be >= 1, got {aggregators}")
        names = sorted(shapes)
        load = [0] * aggregators
        owner: dict[str, int] = {}
        for name in sorted(names, key=lambda n: (-prod(shapes[n]), n)):
            a = min(range(aggregators), key=lambda i: (load[i], i))
            owner[name] = a
            load[a] += prod(shapes[name])
        params = tuple(
            Param(i, n, tuple(int(d) for d in shapes[n]), owner[n]) for i, n in enumerate(names)
        )
        return cls(params, aggregators)

    def owned(self, aggregator: int) -> list[Param]:
        """The parameters aggregator ``aggregator`` holds, in index order."""
        return [p for p in self.params if p.owner == aggregator]

    def index(self) -> dict[str, Param]:
        return {p.name: p for p in self.params}

    def digest(self) -> str:
        """A short hash of the names, shapes and owners: two parties with the same digest cut
        the model the same way (the ticket carries the server's)."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.to_json()).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {
            "aggregators": self.aggregators,
            "params": [[p.name, list(p.shape), p.owner] for p in self.params],
        }

    @classmethod
    def from_json(cls, raw: dict) -> Layout:
        params = tuple(
            Param(i, str(name), tuple(int(d) for d in shape), int(owner))
            for i, (name, shape, owner) in enumerate(raw["params"])
        )
        return cls(params, int(raw["aggregators"]))


def rows_to_elements(shape: Sequence[int], row_start: int, rows: int) -> tuple[int, int]:
    """The flat element range of ``rows`` rows from ``row_start`` of a tensor of ``shape``."""
    inner = prod(shape[1:]) if len(shape) > 1 else 1
    return row_start * inner, (row_start + rows) * inner


def local_range(param) -> tuple[int, int]:
    """The flat element range ``[start, stop)`` of the full parameter that this rank's shard of
    ``param`` (a DTensor sharded on dim 0, or a plain tensor: all of it) holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return 0, param.numel()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if any(offset[1:]) or tuple(local_shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"a shard of {tuple(param.shape)} is not a run of whole rows")
    return rows_to_elements(param.shape, offset[0], local_shape[0] if local_shape else 0)
