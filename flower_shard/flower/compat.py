"""The Flower releases flower-shard works with, checked before anything starts.

The node's warm ClientApp (:mod:`~flower_shard.flower.node.warm_superexec`) and fast
SuperNode (:mod:`~flower_shard.flower.node.fast_supernode`) subclass and patch Flower internals
that change between minor releases without notice; they were tested with the releases of
:data:`SUPPORTED`. Another release fails here with one line, not somewhere inside Flower.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flower_shard.errors import ConfigError

SUPPORTED = ((1, 42), (1, 43))
"""[lowest, highest) (major, minor) of flwr: the range pyproject.toml pins."""


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED
    return f">={a}.{b},<{c}.{d}"


def check_flwr(installed: str | None = None) -> str:
    """The installed flwr version, if :data:`SUPPORTED` covers it.

    Raises
    ------
    ConfigError
        flwr is missing, or of a release outside the range (the message names both).
    """
    if installed is None:
        try:
            installed = version("flwr")
        except PackageNotFoundError:
            raise ConfigError(
                f"flwr is not installed: pip install 'flwr[simulation]{supported_range()}'"
            ) from None
    parts = installed.split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        release = None
    if release is None or not SUPPORTED[0] <= release < SUPPORTED[1]:
        raise ConfigError(
            f"flwr {installed} is installed, but flower-shard supports flwr{supported_range()} "
            f"(it patches Flower internals): pip install 'flwr[simulation]{supported_range()}'"
        )
    return installed
