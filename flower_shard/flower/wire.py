"""What travels between the groups and the server, and between a ClientApp and its group.

Two formats, one module, so that the group (:mod:`flower_shard.flower.group`) and the server
(:mod:`flower_shard.flower.server`) read and write the same bytes without importing each other:

- **weights**: a model's named float32 arrays, flattened and concatenated in sorted-name order
  into one vector (:func:`pack` / :func:`unpack`); Flower pays a request and a hash per object at
  every hop, so one Array per message instead of one per tensor. :func:`flatten` /
  :func:`unflatten` are the same cut in a caller's own order, as torch tensors (the outer
  optimizer's flat state).
- **control-service messages**: a 4-byte header length, a JSON header, then safetensors bytes
  (:func:`encode` / :func:`decode`), on the node's local gRPC channel, for calls without
  weights; calls with weights are a stream of frames (:func:`frames` / :func:`assemble`): a
  JSON header with the arrays' names, dtypes and shapes, then each array's bytes in frames of
  at most :data:`FRAME_BYTES`. No gRPC message is larger than that (gRPC frames a message with
  a 4-byte length: nothing of 4 GiB or more passes in one), and the receiver writes each frame
  straight into the array it belongs to (one copy of the weights, not the message plus the
  arrays).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from flower_shard.protocol import PACKED

Arrays = Mapping[str, np.ndarray]
Spec = Mapping[str, tuple[tuple[int, ...], str]]
"""Name -> (shape, dtype) of a model: what every reply must match."""


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


FRAME_BYTES = 4 << 20
"""The largest frame of a stream of weights (4 MiB: gRPC's default message limit)."""
MAX_MESSAGE = FRAME_BYTES + (1 << 20)
"""The control service's gRPC message limit: a frame and its framing (the JSON first frame of
a stream, and Health, are far smaller)."""
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
FRAME_DTYPES = frozenset({"float32", "float16", "float64", "int8", "uint8", "int32", "int64"})
"""What a stream of weights may carry (the model's float32, the compressed payloads)."""


def frames(
    header: dict, arrays: Arrays | None = None, frame_bytes: int = FRAME_BYTES
) -> Iterator[bytes]:
    """``header`` and ``arrays`` as a stream: one JSON frame naming each array's dtype and
    shape, then each array's bytes (C order) cut into frames of at most ``frame_bytes``; a
    frame never holds parts of two arrays. Made lazily: one frame in memory at a time."""
    arrays = arrays or {}
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    layout = [[k, str(v.dtype), list(v.shape)] for k, v in contiguous.items()]
    yield json.dumps({"header": header, "arrays": layout}).encode()
    for v in contiguous.values():
        data = memoryview(v.reshape(-1)).cast("B")
        for at in range(0, len(data), frame_bytes):
            yield bytes(data[at : at + frame_bytes])


def assemble(stream: Iterable[bytes]) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and arrays of a stream of :func:`frames`, each frame copied into its array
    as it arrives.

    Raises
    ------
    ValueError
        A stream that is not one: a first frame that is not the JSON layout, a dtype or shape
        that is not one, a frame that runs past its array, too few or too many frames.
    """
    stream = iter(stream)
    try:
        first = json.loads(next(stream))
        header, layout = first["header"], first["arrays"]
        arrays = {}
        for name, dtype, shape in layout:
            if dtype not in FRAME_DTYPES or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ValueError(f"array {name!r}: dtype {dtype} shape {shape}")
            arrays[str(name)] = np.empty(shape, dtype=dtype)
    except (StopIteration, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a stream of weights: bad first frame ({exc})") from None
    for name, array in arrays.items():
        target, filled = memoryview(array.reshape(-1)).cast("B"), 0
        while filled < len(target):
            frame = next(stream, None)
            if frame is None:
                raise ValueError(f"the stream ended inside array {name!r}")
            if len(frame) > len(target) - filled:
                raise ValueError(f"a frame runs past the end of array {name!r}")
            target[filled : filled + len(frame)] = frame
            filled += len(frame)
    if next(stream, None) is not None:
        raise ValueError("frames after the last array")
    return header, arrays


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
