"""Numeric settings with a declared range, checked in one loop with their types.

A numeric field is declared with :func:`bounded` (``lr: float = bounded(1e-3, 0, 10,
open_lo=True)``): its range lives beside it, and :func:`check_fields` checks every field of a
config dataclass at once: its type (from the annotation: an ``int`` field takes only integers,
a ``float`` field integers or floats, never a bool; ``X | None`` also takes None), then, for a
bounded field, ``not (lo <= value <= hi)`` (the form that refuses NaN as well) and finiteness.
A field of type int or float without a range is a programming error (a test checks that every
numeric field of the configs has one). A pure module: no imports from flower_shard but the
errors.

Also :func:`check_address`, the one check of a ``HOST:PORT`` setting (IPv4 address or host
name, port in [1, 65535]).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from flower_shard.errors import ConfigError

RANGE = "range"
"""The dataclass field metadata key that holds a field's :class:`Range`."""

MAX_PORT = 65535


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take: ``lo``..``hi``, each end open or closed."""

    lo: float
    hi: float
    open_lo: bool = False
    open_hi: bool = False

    def holds(self, value: float) -> bool:
        """Whether ``value`` is inside (NaN never is: every comparison with it is False)."""
        inside = (self.lo < value if self.open_lo else self.lo <= value) and (
            value < self.hi if self.open_hi else value <= self.hi
        )
        return inside and math.isfinite(value)

    def describe(self, integer: bool) -> str:
        """The range in words, as an error message says it."""
        lo, hi = _number(self.lo), _number(self.hi)
        if integer:
            if self.lo == 1 and not self.open_lo:
                return f"a positive integer (at most {hi})"
            return f"an integer in [{lo}, {hi}]"
        return f"{'>' if self.open_lo else '>='} {lo} and {'<' if self.open_hi else '<='} {hi}"


def _number(x: float) -> str:
    """1e7 as 10000000, 0.5 as 0.5, 2**32 - 1 in full."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def bounded(
    default: Any, lo: float, hi: float, *, open_lo: bool = False, open_hi: bool = False
) -> Any:
    """A dataclass field whose value must lie in the range ``lo``..``hi``."""
    rng = Range(lo, hi, open_lo, open_hi)
    if default is not None and not rng.holds(default):
        raise ValueError(f"default {default!r} is outside its own range {rng}")
    return dataclasses.field(default=default, metadata={RANGE: rng})


def range_of(field: dataclasses.Field) -> Range | None:
    """The range of a field declared with :func:`bounded`, else None."""
    return field.metadata.get(RANGE)


def base_type(field: dataclasses.Field) -> tuple[str, bool]:
    """The annotation's type name and whether it admits None (``int | None`` -> int, True)."""
    parts = [p.strip() for p in str(field.type).split("|")]
    optional = "None" in parts
    rest = [p for p in parts if p != "None"]
    return (rest[0] if len(rest) == 1 else str(field.type)), optional


def numeric_fields(config) -> list[dataclasses.Field]:
    """The int and float fields of the dataclass ``config`` (instance or class)."""
    return [f for f in dataclasses.fields(config) if base_type(f)[0] in ("int", "float")]


def _type_error(name: str, kind: str, value) -> str | None:
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if isinstance(value, bool):
        return "a number, not a bool"
    if kind == "int":
        return None if isinstance(value, int) else "an integer"
    if kind == "float":
        return None if isinstance(value, (int, float)) else "a number"
    return None


def check_fields(config, prefix: str = "--", skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`ConfigError` (one line naming the flag) on the first field of the dataclass
    ``config`` whose value has the wrong type or lies outside its declared range; the flag is
    ``prefix`` + the field's kebab-case name. Fields named in ``skip`` are not checked."""
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        flag = prefix + f.name.replace("_", "-")
        value = getattr(config, f.name)
        kind, optional = base_type(f)
        if value is None and optional:
            continue
        wrong = _type_error(f.name, kind, value)
        if wrong is not None:
            raise ConfigError(f"{flag} must be {wrong}, got {value!r}")
        rng = range_of(f)
        if rng is not None and not rng.holds(value):
            raise ConfigError(f"{flag} must be {rng.describe(kind == 'int')}, got {value!r}")


def check_address(flag: str, address: str, *, port_zero: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); raise :class:`ConfigError` unless HOST is an IPv4 address
    or a host name and PORT is in [1, 65535] (or 0, "any free port", with ``port_zero``)."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host:
        raise ConfigError(f"{flag} {address!r} must be HOST:PORT")
    check_host(flag, host, address)
    low = 0 if port_zero else 1
    if not port.isascii() or not port.isdigit() or not low <= int(port) <= MAX_PORT:
        raise ConfigError(
            f"{flag} {address!r} must be HOST:PORT with a port in [{low}, {MAX_PORT}]"
        )
    return host, int(port)


def check_host(flag: str, host: str, shown: str | None = None) -> str:
    """Raise :class:`ConfigError` unless ``host`` is an IPv4 address or a host name (IPv6
    literals are not supported: torch's stores and gloo take HOST:PORT without brackets)."""
    shown = host if shown is None else shown
    if not host or any(c in host for c in ":[]/ \t") or not host.isascii():
        raise ConfigError(
            f"{flag} {shown!r}: give an IPv4 address or a host name (and :PORT where one is "
            "expected); IPv6 literals are not supported"
        )
    return host
