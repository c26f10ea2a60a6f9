"""`ConfigError`: a bad configuration value, named by the CLI flag that fixes it.

Its own module so that the config's small tables (core/config/layouts.py) can raise it
without importing TrainConfig, which imports them.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; `flag` names the CLI flag to fix."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message
