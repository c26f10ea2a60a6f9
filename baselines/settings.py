"""The baselines' own settings: one typed dataclass, recorded in config.json, turned into CLI flags.

Contract:
- `BaselineConfig` holds every knob of the three baselines (checkpoint-restart,
  elastic, torchft); each field has a one-line doc that becomes its `--flag`'s help
  (`core.config.train_config.add_dataclass_flags`). A run records the whole dataclass as the
  "baseline" section of DIR/config.json, so a result always says how its baseline
  was set up (checkpoint cadence, what a smaller group does, rendezvous timeouts).
- `validate(cfg)` raises `ConfigError(flag, message)` for the first bad value,
  before any process starts, like `TrainConfig.validate`.
- Workers read the settings back with `load_settings(DIR/config.json)`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from recover.core.config.train_config import ConfigError, TrainConfig, field_flag, flag_name
from recover.core.config.fields import doc_field as _f

RESTART_MODES = ("survivors", "replace")
ELASTIC_BATCH = ("keep-global", "keep-per-replica")


@dataclass
class BaselineConfig:
    """Settings of the checkpoint-restart, elastic and torchft baselines."""

    # Same concepts as recover's: one flag each (core.config.train_config.add_dataclass_flags `same_as`); the
    # old flags --ckpt-every, --ckpt-keep and --replace-wait still parse, hidden.
    ckpt_every: int = _f(5, "checkpoint-restart/elastic: save a DCP checkpoint every K iterations",
                         same_as="checkpoint_every")
    ckpt_async: bool = _f(False, "checkpoint-restart/elastic: save with dcp.async_save instead of dcp.save "
                                 "(recover always saves asynchronously)", flag="--checkpoint-async")
    ckpt_keep: int = _f(2, "checkpoint-restart/elastic: complete checkpoints kept on disk (older ones deleted)",
                        same_as="checkpoint_keep")
    restart_mode: str = _f(
        "survivors", "checkpoint-restart: restart with the 'survivors' only, or with a 'replace'ment replica"
    )
    replace_wait: float = _f(0.0, "checkpoint-restart: seconds to wait for a replacement replica (replace mode)",
                             same_as="replace_after")
    max_restarts: int = _f(10, "checkpoint-restart/elastic: restarts allowed before the run gives up")
    elastic_batch: str = _f(
        "keep-global",
        "elastic: a smaller group 'keep-global' (accumulate more, M kept) or 'keep-per-replica' (M shrinks)",
    )
    elastic_min_nodes: int = _f(1, "elastic: the fewest nodes (agents) the group may shrink to (--nnodes MIN:R)")
    rdzv_last_call_timeout: int = _f(
        1, "elastic: whole seconds a rendezvous waits for more nodes once MIN have joined (torch default 30)"
    )
    rdzv_join_timeout: int = _f(60, "elastic: whole seconds a rendezvous may take before the agent gives up (torch default 600)")
    rdzv_keep_alive_interval: int = _f(
        1, "elastic: whole seconds between an agent's rendezvous heartbeats (torch default 5)"
    )
    rdzv_keep_alive_max_attempt: int = _f(
        2, "elastic: missed heartbeats after which a node counts as dead (torch default 3)"
    )
    monitor_interval: float = _f(0.1, "elastic: seconds between an agent's checks of its workers (torch default 0.1 as of 2.13)")
    torchft_min_replicas: int = _f(1, "torchft: fewest replica groups a quorum may have")
    torchft_join_timeout_ms: int = _f(
        1000, "torchft: ms the lighthouse waits for missing replicas before forming a smaller quorum (default 60000)"
    )
    torchft_heartbeat_timeout_ms: int = _f(
        1000, "torchft: ms without a heartbeat after which the lighthouse drops a replica (default 5000)"
    )
    torchft_heartbeat_ms: int = _f(100, "torchft: ms between a manager's heartbeats to the lighthouse (default 100)")
    torchft_timeout: float = _f(10.0, "torchft: seconds an all-reduce or a quorum may take before it fails (its commit "
                                       "vote: twice that)")

    def validate(self, cfg: TrainConfig) -> None:
        """Raise ConfigError for the first bad value (before any process starts)."""
        for name in ("ckpt_every", "ckpt_keep", "torchft_min_replicas", "torchft_join_timeout_ms",
                     "torchft_heartbeat_timeout_ms", "torchft_heartbeat_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(field_flag(BaselineConfig, name), f"must be >= 1, got {getattr(self, name)}")
        for name in ("rdzv_last_call_timeout", "rdzv_join_timeout", "rdzv_keep_alive_interval",
                     "rdzv_keep_alive_max_attempt"):
            if getattr(self, name) < 1:
                raise ConfigError(flag_name(name), f"must be >= 1 (torchrun takes whole seconds), got {getattr(self, name)}")
        for name in ("replace_wait", "max_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(field_flag(BaselineConfig, name), f"must be >= 0, got {getattr(self, name)}")
        for name in ("monitor_interval", "torchft_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(flag_name(name), f"must be > 0, got {getattr(self, name)}")
        if self.restart_mode not in RESTART_MODES:
            raise ConfigError("--restart-mode", f"unknown mode {self.restart_mode!r}; choose from {', '.join(RESTART_MODES)}")
        if self.elastic_batch not in ELASTIC_BATCH:
            raise ConfigError("--elastic-batch", f"unknown setting {self.elastic_batch!r}; choose from {', '.join(ELASTIC_BATCH)}")
        if not 1 <= self.elastic_min_nodes <= cfg.replicas:
            raise ConfigError("--elastic-min-nodes", f"must be in 1..--replicas ({cfg.replicas}), got {self.elastic_min_nodes}")
        if self.torchft_min_replicas > cfg.replicas:
            raise ConfigError("--torchft-min-replicas", f"must be <= --replicas ({cfg.replicas}), got {self.torchft_min_replicas}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BaselineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def load_settings(config_path: str | os.PathLike) -> BaselineConfig:
    """The "baseline" section of DIR/config.json (defaults where absent)."""
    d = json.loads(Path(config_path).read_text())
    return BaselineConfig.from_dict(d.get("baseline", {}))
