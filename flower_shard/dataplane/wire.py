"""Frames of the data plane: a fixed binary header per chunk, then the chunk's values.

A chunk is a contiguous run of one parameter's flattened elements, ``count`` values from
element ``start``, encoded as the stream's compression says (:mod:`flower_shard.runtime.
compression`: float32, bf16, or int8 with one float32 scale per ``chunk`` values, scales first
so a frame never needs re-slicing at an unaligned offset). Control messages (a stream's opening
header, its summary, the ServerApp's calls) are JSON. No gRPC message may exceed
:data:`MAX_MESSAGE` bytes: a sender cuts its shard into chunks of at most :data:`CHUNK_VALUES`.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from flower_shard.config import choices as C

SERVICE = "flower_shard.DataPlane"
UPLOAD = "Upload"  # stream of frames from a rank -> summary
DOWNLOAD = "Download"  # request -> stream of frames to a rank
CONTROL = "Control"  # the ServerApp's calls (JSON -> JSON)

MAX_MESSAGE = 64 << 20  # the largest gRPC message either side accepts
CHUNK_VALUES = 1 << 20  # values per chunk by default: 4 MiB of float32
HEADER = struct.Struct("<IQI")  # parameter index, first element, number of elements
WITHDRAW = b"withdraw"
"""An upload's last frame when the rank gives it up (another aggregator refused it): the
aggregator drops the group's upload, as every aggregator then does (shorter than a header)."""
END = b"end"
"""An upload's last frame when the rank sent all it meant to. A stream that ends without it is
broken off: gRPC may end a dead peer's request stream as if it were complete, before it
reports the cancel, so the aggregator cannot tell the two apart otherwise."""
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]

VALUE_BYTES = {C.NO_COMPRESSION: 4, C.BF16: 2, C.INT8: 1}


def blocks_of(start: int, count: int, scale_chunk: int) -> tuple[int, int]:
    """The int8 scale blocks ``[first, last)`` that elements ``[start, start + count)`` touch.

    Blocks are aligned to the parameter's own element 0 (block ``j`` is elements
    ``[j * scale_chunk, (j + 1) * scale_chunk)``), so every slice of a parameter decodes to the
    same values whatever range a receiver asks for.
    """
    if count <= 0:
        return start // scale_chunk, start // scale_chunk
    return start // scale_chunk, (start + count - 1) // scale_chunk + 1


def payload_size(kind: str, start: int, count: int, scale_chunk: int) -> int:
    """Bytes after the header of a frame of ``count`` values from element ``start``."""
    first, last = blocks_of(start, count, scale_chunk)
    scales = 4 * (last - first) if kind == C.INT8 else 0
    return scales + VALUE_BYTES[kind] * count


def quantize(values: np.ndarray, start: int, kind: str, scale_chunk: int) -> tuple:
    """``(scales, data)`` of float32 ``values`` that begin at element ``start`` of their
    parameter: int8 with one absmax/127 scale per aligned block, bf16 bits (round to nearest
    even, as torch), or the float32 values themselves (scales empty)."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    none = np.zeros(0, dtype=np.float32)
    if kind == C.NO_COMPRESSION:
        return none, values
    if kind == C.BF16:
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return none, rounded.astype(np.uint16)
    first, last = blocks_of(start, values.size, scale_chunk)
    lead = start - first * scale_chunk  # values of the first block before ``start``: none here
    padded = np.zeros((last - first) * scale_chunk, dtype=np.float32)
    padded[lead : lead + values.size] = values
    blocks = padded.reshape(-1, scale_chunk)
    scales = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    divisor = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks / divisor[:, None]), -127, 127).astype(np.int8).reshape(-1)
    return scales, q[lead : lead + values.size]


def dequantize(scales: np.ndarray, data: np.ndarray, start: int, kind: str, scale_chunk: int):
    """The float32 values that ``quantize`` encoded (elements from ``start``)."""
    if kind == C.NO_COMPRESSION:
        return np.asarray(data, dtype=np.float32)
    if kind == C.BF16:
        return (np.asarray(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    first = start // scale_chunk
    block = (np.arange(start, start + data.size) // scale_chunk) - first
    return data.astype(np.float32) * scales[block]


def encode_chunk(
    param: int, start: int, values: np.ndarray, kind: str, scale_chunk: int, quantized=None
) -> bytes:
    """A frame: the header, then (int8) the scales and the values. ``quantized`` (scales, data)
    is sent as is when given (a precomputed slice), else ``values`` are quantized."""
    scales, data = (
        quantized if quantized is not None else quantize(values, start, kind, scale_chunk)
    )
    head = HEADER.pack(param, start, data.size)
    # one copy into the frame (join takes the arrays' buffers), not one per part and a concat
    return b"".join(
        (head, memoryview(np.ascontiguousarray(scales)), memoryview(np.ascontiguousarray(data)))
    )


def decode_header(frame: bytes) -> tuple[int, int, int]:
    """(parameter index, first element, count) of a frame; ValueError if too short."""
    if len(frame) < HEADER.size:
        raise ValueError(f"a frame of {len(frame)} bytes has no header")
    return HEADER.unpack_from(frame)


def decode_values(frame, kind: str, scale_chunk: int) -> np.ndarray:
    """The float32 values of a frame whose size was checked (:func:`payload_size`).

    Uncompressed, a view of the frame's own bytes (read-only for ``bytes``): no copy, which
    matters at 4 MiB a frame; callers copy what they keep."""
    _, start, count = HEADER.unpack_from(frame)
    body = memoryview(frame)[HEADER.size :]
    first, last = blocks_of(start, count, scale_chunk)
    n_scales = (last - first) if kind == C.INT8 else 0
    scales = np.frombuffer(body[: 4 * n_scales], dtype=np.float32)
    dtype = {C.NO_COMPRESSION: np.float32, C.BF16: np.uint16, C.INT8: np.int8}[kind]
    data = np.frombuffer(body[4 * n_scales :], dtype=dtype)
    return dequantize(scales, data, start, kind, scale_chunk)


def to_json(obj) -> bytes:
    return json.dumps(obj).encode()


def from_json(data: bytes):
    return json.loads(data)
