"""Compressed exchange between groups: the pseudo-gradient as bf16 or int8, with error feedback.

What is compressed is the pseudo-gradient ``delta = w - x``: how far a group's weights ``x``
moved from the last global weights ``w`` in one round. It is small and zero-centred, so it
survives 8 bits far better than the weights themselves; the receiver rebuilds the next global
weights from the mean of the decompressed deltas (``w - mean``, or DiLoCo's Nesterov step with
the mean as its gradient).

Formats, on a flat float32 tensor of ``n`` values (the same code runs on a rank's shards in the
collective transport and on the whole model in the Flower transport):

``none``
    float32, as is (4 bytes per value).
``bf16``
    round-to-nearest-even bfloat16, sent as its 16 raw bits (2 bytes per value).
``int8``
    the values cut into chunks of ``chunk`` (the last one zero-padded); per chunk a float32
    scale ``s = max|v| / 127`` and ``q = round(v / s)`` in [-127, 127] (1 byte per value plus
    4 bytes per chunk). Decompression is ``q x s``. A chunk of zeros has scale 0 and decodes
    to zeros.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): each group keeps what
compression lost, ``e = (delta + e) - decompress(compress(delta + e))``, and adds it to the next
round's delta, so no part of an update is lost for good, only delayed. The identity
``decompress(sent) + e_new == delta + e_old`` holds bit for bit (the subtraction is exact: the
decoded value lies within a factor 2 of the input, or is 0).

A delta with a non-finite value gives a non-finite scale (int8) or value (bf16): the receiver's
:func:`check_payload` refuses it, and the sender's residual starts again from zero.
"""

from __future__ import annotations

import math

import torch

from flower_shard.config.choices import BF16, COMPRESSIONS, INT8, NO_COMPRESSION

KINDS = COMPRESSIONS  # none, bf16, int8
INT8_MAX = 127

# Names of the arrays of a compressed payload (Flower ArrayRecord keys).
DATA = "delta.data"
SCALES = "delta.scales"


def num_chunks(numel: int, chunk: int) -> int:
    return math.ceil(numel / chunk)


def spec(kind: str, numel: int, chunk: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the payload of ``numel`` values: what a receiver expects."""
    if kind == NO_COMPRESSION:
        return {DATA: ((numel,), torch.float32)}
    if kind == BF16:
        return {DATA: ((numel,), torch.int16)}
    if kind == INT8:
        return {DATA: ((numel,), torch.int8), SCALES: ((num_chunks(numel, chunk),), torch.float32)}
    raise ValueError(f"compression {kind!r} is unknown; choose one of {', '.join(KINDS)}")


def payload_bytes(kind: str, numel: int, chunk: int) -> int:
    """Bytes of one payload of ``numel`` values (what travels per group)."""
    return sum(
        math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        for shape, dtype in spec(kind, numel, chunk).values()
    )


def compress(values: torch.Tensor, kind: str, chunk: int) -> dict[str, torch.Tensor]:
    """Encode a flat float32 tensor; see the module docstring for the formats."""
    values = values.reshape(-1).float()
    if kind == NO_COMPRESSION:
        return {DATA: values.clone()}
    if kind == BF16:
        return {DATA: values.to(torch.bfloat16).view(torch.int16)}
    if kind != INT8:
        spec(kind, 0, chunk)  # raises the one-line error
    n = values.numel()
    padded = torch.zeros(num_chunks(n, chunk) * chunk, dtype=torch.float32, device=values.device)
    padded[:n] = values
    blocks = padded.view(-1, chunk)
    scales = blocks.abs().amax(dim=1) / INT8_MAX
    # A zero chunk divides by 1 instead of 0 (its values are 0 either way).
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / divisor[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {DATA: q.reshape(-1)[:n].clone(), SCALES: scales}


def decompress(payload: dict[str, torch.Tensor], kind: str, chunk: int) -> torch.Tensor:
    """The flat float32 tensor that a payload stands for."""
    data = payload[DATA]
    if kind == NO_COMPRESSION:
        return data.float()
    if kind == BF16:
        return data.view(torch.bfloat16).float()
    n = data.numel()
    padded = torch.zeros(num_chunks(n, chunk) * chunk, dtype=torch.float32, device=data.device)
    padded[:n] = data.float()
    return (padded.view(-1, chunk) * payload[SCALES][:, None]).reshape(-1)[:n]


def check_payload(payload: dict, kind: str, numel: int, chunk: int) -> str | None:
    """Why a received payload cannot be used, or None: keys, shapes, dtypes, finiteness."""
    expected = spec(kind, numel, chunk)
    missing = sorted(set(expected) - set(payload))
    extra = sorted(set(payload) - set(expected))
    if missing or extra:
        return f"compressed payload has arrays {sorted(payload)}, expected {sorted(expected)}"
    for name, (shape, dtype) in expected.items():
        t = payload[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            return (
                f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype} "
                f"(compression {kind})"
            )
    if kind == INT8:
        scales = payload[SCALES]
        if not torch.isfinite(scales).all() or (scales < 0).any():
            return f"{SCALES} has non-finite or negative values"
    elif not torch.isfinite(decompress(payload, kind, chunk)).all():
        return f"{DATA} has non-finite values"
    return None


def to_bytes(payload: dict[str, torch.Tensor]) -> torch.Tensor:
    """The payload as one flat uint8 tensor (data, then scales): one collective moves it."""
    return torch.cat(
        [payload[k].contiguous().view(torch.uint8) for k in (DATA, SCALES) if k in payload]
    )


def from_bytes(raw: torch.Tensor, kind: str, numel: int, chunk: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_bytes` for a payload of ``numel`` values (any ``numel``: an array
    that does not start on a multiple of its item size is copied, not viewed)."""
    out, offset = {}, 0
    for name, (shape, dtype) in spec(kind, numel, chunk).items():
        width = torch.empty(0, dtype=dtype).element_size()
        size = math.prod(shape) * width
        part = raw[offset : offset + size]
        # int8 data of n values puts the scales at byte n: a float32 view needs an offset that
        # is a multiple of 4 (any n that is not, e.g. an uneven shard), so copy those bytes.
        if part.storage_offset() % width:
            part = part.clone()
        out[name] = part.view(dtype).reshape(shape)
        offset += size
    return out


def mean_of(
    raws: list[torch.Tensor], kind: str, numel: int, chunk: int, shares: list[float] | None = None
) -> torch.Tensor:
    """The mean of the groups' payloads (raw bytes, :func:`to_bytes`), decoded and added up in
    group order so that every receiver gets the same bits; ``shares``: each group's weight
    ``w_g / sum w`` (None: the plain mean, computed as SUM / G)."""
    mean = None
    for g, raw in enumerate(raws):
        decoded = decompress(from_bytes(raw, kind, numel, chunk), kind, chunk)
        part = decoded if shares is None else decoded * shares[g]
        mean = part.clone() if mean is None else mean.add_(part)
    return mean.div_(len(raws)) if shares is None else mean


class ErrorFeedback:
    """Compresses a sender's successive deltas, carrying what each round loses to the next.

    Parameters
    ----------
    kind, chunk
        The format (see the module docstring).
    numel
        Length of the flat deltas.
    enabled
        False sends each delta compressed on its own (no memory); the residual stays zero.
    device
        Where the residual lives (the deltas' device).
    """

    def __init__(self, kind: str, chunk: int, numel: int, enabled: bool = True, device=None):
        spec(kind, numel, chunk)  # fail on an unknown kind now, not at the first round
        self.kind, self.chunk, self.enabled = kind, chunk, enabled and kind != NO_COMPRESSION
        self.residual = torch.zeros(numel if self.enabled else 0, device=device)

    @torch.no_grad()
    def compress(self, delta: torch.Tensor, start: int = 0) -> dict[str, torch.Tensor]:
        """The payload for ``delta`` (plus the residual); updates the residual.

        ``start``: ``delta`` covers the values ``[start, start + len(delta))`` of the flat
        deltas (one fragment of a fragmented sync), which keep their own residual."""
        stop = start + delta.numel()
        residual = self.residual[start:stop]
        target = delta + residual if self.enabled else delta
        payload = compress(target, self.kind, self.chunk)
        if self.enabled:
            residual.copy_(target - decompress(payload, self.kind, self.chunk))
            if not torch.isfinite(residual).all():
                # A diverged delta: its payload will be refused; do not let it poison the
                # rounds after it (the group reloads finite global weights next round).
                residual.zero_()
        return payload
