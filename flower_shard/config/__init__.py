"""Configuration: typed dataclasses, each field documented and checked where it is declared.

No I/O here: what needs the disk, ``transformers`` or CUDA is checked by
:mod:`flower_shard.preflight` before any process starts.
"""

from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError

__all__ = ["ConfigError", "TrainConfig"]
