"""What travels between the groups and the server, and between a ClientApp and its group.

Two formats, one module, so that the group (:mod:`flower_shard.flower.group`) and the server
(:mod:`flower_shard.flower.server`) read and write the same bytes without importing each other:

- **weights**: a model's named float32 arrays, flattened and concatenated in sorted-name order
  into one vector (:func:`pack` / :func:`unpack`); Flower pays a request and a hash per object at
  every hop, so one Array per message instead of one per tensor. :func:`flatten` /
  :func:`unflatten` are the same cut in a caller's own order, as torch tensors (the outer
  optimizer's flat state).
- **control-service messages**: a 4-byte header length, a JSON header, then safetensors bytes
  (:func:`encode` / :func:`decode`), on the node's local gRPC channel.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np

from flower_shard.protocol import PACKED

Arrays = Mapping[str, np.ndarray]
Spec = Mapping[str, tuple[tuple[int, ...], str]]
"""Name -> (shape, dtype) of a model: what every reply must match."""

GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def encode(header: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """A control-service message: 4-byte header length, JSON header, then safetensors bytes."""
    from safetensors.numpy import save

    head = json.dumps(header).encode()
    body = save(arrays) if arrays else b""
    return struct.pack("<I", len(head)) + head + body


def decode(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and arrays of an :func:`encode`d message."""
    from safetensors.numpy import load

    (n,) = struct.unpack_from("<I", data)
    header = json.loads(data[4 : 4 + n])
    body = data[4 + n :]
    return header, (load(body) if body else {})


def describe(arrays: Arrays) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of a model: what every reply must match."""
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}


def pack(arrays: Arrays) -> np.ndarray:
    """Every array, flattened and concatenated in sorted-name order, as one float32 vector.

    The flower transport's wire format: one Array per message instead of one per tensor, so
    Flower's per-object costs (a request and a hash at every hop) are paid a few times per
    message, not hundreds."""
    return np.concatenate(
        [np.ascontiguousarray(arrays[k], dtype=np.float32).reshape(-1) for k in sorted(arrays)]
    )


def unpack(arrays: Arrays, expected: Spec) -> tuple[str | None, dict[str, np.ndarray]]:
    """(why a packed reply cannot be used, {}) or (None, its named arrays): exactly one
    1-D float32 array named ``packed`` holding every expected value, cut in sorted order."""
    if PACKED not in arrays:
        return f"missing arrays [{PACKED!r}]", {}
    if len(arrays) > 1:
        return f"unexpected arrays {sorted(set(arrays) - {PACKED})[:3]}", {}
    flat = arrays[PACKED]
    numel = sum(int(np.prod(shape)) for shape, _ in expected.values())
    if flat.ndim != 1 or flat.size != numel:
        return f"wrong shape: packed weights {tuple(flat.shape)}, expected ({numel},)", {}
    if flat.dtype != np.float32:
        return f"packed weights have dtype {flat.dtype}, expected float32", {}
    return None, unflatten_flat(flat, expected, sorted(expected))


def unflatten_flat(flat: np.ndarray, expected: Spec, order: list[str]) -> dict[str, np.ndarray]:
    """A flat numpy vector cut into named arrays of the ``expected`` shapes, in ``order``."""
    out, offset = {}, 0
    for k in order:
        shape = expected[k][0]
        n = int(np.prod(shape))
        out[k] = flat[offset : offset + n].reshape(shape)
        offset += n
    return out


def flatten(arrays: Arrays, order: list[str]):
    """The arrays as one flat torch tensor, concatenated in ``order`` (no copy of the values'
    dtype: float32 arrays give a float32 tensor)."""
    import torch

    return torch.cat([torch.from_numpy(np.ascontiguousarray(arrays[k])).reshape(-1) for k in order])


def unflatten(flat, like: Arrays, order: list[str]) -> dict[str, np.ndarray]:
    """A flat torch tensor cut back into numpy arrays shaped like ``like``, in ``order``."""
    out, offset = {}, 0
    flat = flat.detach().cpu().numpy()
    for k in order:
        n = like[k].size
        out[k] = flat[offset : offset + n].reshape(like[k].shape).copy()
        offset += n
    return out
