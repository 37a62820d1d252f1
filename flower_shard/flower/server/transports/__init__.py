"""The transports, one module each, found by their run-config name (``transport``).

A new transport is one module with a :class:`~.base.Transport` subclass, and one entry here
under its name in :data:`flower_shard.protocol.TRANSPORTS`.
"""

from __future__ import annotations

from flower_shard import protocol as P
from flower_shard.errors import ConfigError
from flower_shard.flower.server.transports.base import Aggregate, Transport
from flower_shard.flower.server.transports.collective import CollectiveTransport
from flower_shard.flower.server.transports.flower import FlowerTransport
from flower_shard.flower.server.transports.streaming import StreamingTransport

TRANSPORTS: dict[str, type[Transport]] = {
    P.FLOWER: FlowerTransport,
    P.COLLECTIVE: CollectiveTransport,
    P.STREAMING: StreamingTransport,
}


def transport_class(name: str) -> type[Transport]:
    """The server side of transport ``name``; ConfigError if this server has none."""
    if name not in TRANSPORTS:
        raise ConfigError(
            f"transport {name!r} has no server side here; choose one of {', '.join(TRANSPORTS)}"
        )
    return TRANSPORTS[name]


__all__ = [
    "TRANSPORTS",
    "Aggregate",
    "CollectiveTransport",
    "FlowerTransport",
    "Transport",
    "transport_class",
]
