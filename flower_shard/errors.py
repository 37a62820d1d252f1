"""The project's exceptions, in one leaf module that every layer may import.

Each carries one line that names the problem and how to fix it: the CLI prints that line and
exits with status 2 (configuration) or 1 (a run that failed).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line that says how to fix it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the run; the message says which."""


class GroupUnavailable(RuntimeError):
    """A group's control service did not answer."""


class GroupError(RuntimeError):
    """A group answered with an error."""
