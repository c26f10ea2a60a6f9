"""The one vocabulary for systems: a system's name plus the settings that make a variant of it.

Contract:
- A system is named as `recover train --system` names it (experiments/systems.py:
  plain, recover, ckpt-restart, elastic, torchft). Everything that shows or stores a
  system (experiment grids, aggregation, the simulator's policies and its results
  files, validation, figures) uses `variant_label(system, settings)`, never a
  spelling of its own.
- A label is the system's name, then one `-tag` per labelled setting of that system
  (VARIANT_SETTINGS): settings marked `always` are always shown (elastic's batch rule
  has no neutral value: `elastic-keep-global`, `elastic-keep-per-replica`); the others
  only when they differ from the baseline's default (BaselineConfig), so the label a
  default run gets is the bare name.
- `plain`, the failure-free reference, is labelled "failure-free" (its role in
  every comparison).
- The defaults recorded here are BaselineConfig's, or TrainConfig's for a setting of
  section "train" (a test checks they agree); `config_settings(config)` gathers a run's
  labelled settings from its config.json sections; this
  module imports nothing of the project, so the simulator stays free of torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

FAILURE_FREE = "failure-free"
"""The label of `plain` runs: the failure-free reference of a comparison."""


@dataclass(frozen=True)
class VariantSetting:
    """A setting whose value names a variant of a system."""

    system: str  # the `--system` it belongs to
    name: str  # its BaselineConfig field (config.json "baseline" key)
    default: Any  # BaselineConfig's default (checked by a test)
    tag: Callable[[Any], str]  # the label's suffix for a value
    always: bool = False  # shown even at the default value
    section: str = "baseline"  # config.json section that records it: "baseline" (BaselineConfig) or "train"


VARIANT_SETTINGS: tuple[VariantSetting, ...] = (
    VariantSetting("elastic", "elastic_batch", "keep-global", str, always=True),
    # The cluster-scale simulation runs these baselines both tuned (the defaults here, as the
    # local baselines are set) and at the upstream defaults (torch's 30 s last-call, torchft's 5 s).
    VariantSetting("elastic", "rdzv_last_call_timeout", 1, lambda v: f"lastcall{v:g}s"),
    VariantSetting("torchft", "torchft_heartbeat_timeout_ms", 1000, lambda v: f"hb{v / 1000:g}s"),
    # Checkpoint-restart saving with dcp.async_save (training stalls for the snapshot only): the
    # setting a competent user picks at cluster scale; the default saves blocking.
    VariantSetting("ckpt-restart", "ckpt_async", False, lambda v: "async" if v else "sync"),
    # recover's hang detection (TrainConfig's heartbeat timeout): the recovery grid also runs it at
    # the baselines' collective timeout, so that every system gets one hang-detection bound.
    VariantSetting("recover", "heartbeat_timeout", 3.0, lambda v: f"hb{v:g}s", section="train"),
    # Bit-identical mode (TrainConfig.exact, core/worker/exact.py): the trajectory grid runs recover and its
    # failure-free reference with it too, where |loss - failure-free loss| is 0 at every step.
    VariantSetting("recover", "exact", False, lambda v: "exact", section="train"),
    VariantSetting("plain", "exact", False, lambda v: "exact", section="train"),
)


def variant_label(system: str, settings: Mapping[str, Any] | None = None) -> str:
    """The label of `system` run with `settings` (BaselineConfig fields, or TrainConfig ones for the
    settings of section "train"; absent ones take their default)."""
    if system == "plain":  # the reference of its comparison, in exact mode a reference of its own
        return FAILURE_FREE + ("-exact" if (settings or {}).get("exact") else "")
    settings = settings or {}
    parts = [system]
    for v in VARIANT_SETTINGS:
        if v.system != system:
            continue
        value = settings.get(v.name, v.default)
        if v.always or value != v.default:
            parts.append(v.tag(value))
    return "-".join(parts)


def config_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The labelled settings a run's config.json records: its "baseline" section, plus the fields of
    its "train" section that a VARIANT_SETTINGS entry of section "train" names."""
    train = config.get("train") or {}
    out = dict(config.get("baseline") or {})
    out.update({v.name: train[v.name] for v in VARIANT_SETTINGS if v.section == "train" and v.name in train})
    return out
