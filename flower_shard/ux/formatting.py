"""How a round reads as text: the one-line summary, numbers and byte counts.

The plain lines of :class:`~flower_shard.ux.progress.RoundDisplay` and the cells of its table
come from here, so both read alike.
"""

from __future__ import annotations

from flower_shard import protocol as P


def format_round(r: dict, total_rounds: int = 0) -> str:
    """One readable line: ``round 3/5 | step 12 | loss 4.123 | ppl 61.7 | 1,530 tok/s | ...``"""
    of = f"/{total_rounds}" if total_rounds else ""
    parts = [
        f"round {r[P.ROUND]}{of}",
        f"step {r[P.STEP]}",
        f"loss {number(r.get(P.TRAIN_LOSS), 4)}",
    ]
    if r.get(P.EVAL_PPL) is not None:
        parts.append(f"ppl {r[P.EVAL_PPL]:.2f}")
    parts += [f"{r[P.TOKENS_PER_S]:,.0f} tok/s", f"lr {r[P.LR]:.2e}"]
    if P.EXCHANGE_BYTES in r:  # a Flower round
        parts.append(f"exchanged {human_bytes(r[P.EXCHANGE_BYTES])}")
        parts.append(f"groups {r[P.GROUPS_OK]} ok/{r[P.GROUPS_REJECTED]} rejected")
    if r.get(P.OUTER_SYNC_BYTES):
        parts.append(f"sync {1e3 * r[P.OUTER_SYNC_S]:.0f} ms {human_bytes(r[P.OUTER_SYNC_BYTES])}")
    if P.ROUND_S in r:
        parts.append(f"round {r[P.ROUND_S]:.1f} s")
    return " | ".join(parts)


def number(x, digits: int) -> str:
    """``x`` with ``digits`` decimals, or ``n/a`` for None (a non-finite value in the log)."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``1.5 kB``, ``3.2 MB``, ``1.0 GB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
