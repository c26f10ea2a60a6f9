"""The two throughput metrics, defined once for every reader: aggregation, the simulator, the figures.

Contract:
- *goodput*: tokens committed and kept (not rolled back), whatever the trajectory, per
  wall second and per GPU-hour held. A system that shrinks the global batch while
  replicas are missing (torchft, elastic-keep-per-replica) keeps training, and its
  tokens count.
- *trajectory-equivalent throughput* (the "effective throughput" of the results
  files): tokens of kept iterations that processed exactly the failure-free run's M
  microbatches, per wall second and per GPU-hour: only the progress the failure-free
  run would also have made. Which steps are on the trajectory is the caller's
  definition (the simulator: exactly M microbatches; aggregation: the same ids as the
  failure-free run and the same loss); the arithmetic and the names are here.
- `rates(tokens, trajectory_tokens, seconds, gpu_hours)` gives the four numbers; a zero
  or unknown denominator (or unknown trajectory tokens) gives None, never a division error.
- `COLUMNS` names each number's column in the results files. In aggregation a
  "GPU-hour" is a process-hour (one rank per GPU), so its columns say process_hour.
- `METRICS` says both in words; summary.json files carry it.
- The paper's 2.23x is a trajectory-equivalent ratio: the claim is reaching the
  failure-free run's model sooner. For recover and ckpt-restart (both always on the
  trajectory) the two metrics are one number.
This module imports nothing of the project (the simulator stays free of torch).
"""
from __future__ import annotations

from dataclasses import dataclass

METRICS: dict[str, str] = {
    "goodput": "tokens committed and kept (not rolled back), whatever the trajectory, per wall second "
               "(goodput_tokens_per_s) and per GPU-hour held (goodput_tokens_per_gpu_hour)",
    "trajectory_equivalent": "tokens of kept iterations that processed exactly the failure-free run's M "
                             "microbatches, per wall second (effective_throughput_tokens_per_s) and per GPU-hour "
                             "(effective_tokens_per_gpu_hour): progress on the failure-free trajectory only",
}
"""The two metrics in words (every summary.json carries this text)."""


@dataclass(frozen=True)
class Rates:
    """The two metrics of one run, each per wall second and per GPU-hour (None where undefined)."""

    goodput_per_s: float | None  # kept tokens / wall seconds
    goodput_per_gpu_hour: float | None  # kept tokens / GPU-hours held
    trajectory_per_s: float | None  # on-trajectory tokens / wall seconds
    trajectory_per_gpu_hour: float | None  # on-trajectory tokens / GPU-hours held


def _per(x: float | None, d: float | None) -> float | None:
    return x / d if x is not None and d else None


def rates(tokens: float, trajectory_tokens: float | None, seconds: float | None,
          gpu_hours: float | None) -> Rates:
    """Goodput and trajectory-equivalent throughput of a run that kept `tokens`, of which
    `trajectory_tokens` on the failure-free trajectory, in `seconds` of wall time holding `gpu_hours`."""
    return Rates(_per(tokens, seconds), _per(tokens, gpu_hours),
                 _per(trajectory_tokens, seconds), _per(trajectory_tokens, gpu_hours))


COLUMNS: dict[str, dict[str, str]] = {
    "simulator": {"goodput_per_s": "goodput_tokens_per_s", "goodput_per_gpu_hour": "goodput_tokens_per_gpu_hour",
                  "trajectory_per_s": "effective_throughput_tokens_per_s",
                  "trajectory_per_gpu_hour": "effective_tokens_per_gpu_hour"},
    "aggregate": {"goodput_per_s": "goodput_tokens_per_s", "goodput_per_gpu_hour": "goodput_tokens_per_process_hour",
                  "trajectory_per_s": "effective_tokens_per_s",
                  "trajectory_per_gpu_hour": "effective_tokens_per_process_hour"},
}
"""Each reader's column name for each number of `Rates` (the files keep their established names)."""


def columns(r: Rates, reader: str) -> dict[str, float | None]:
    """`r` under `reader`'s column names (a key of COLUMNS)."""
    return {col: getattr(r, field) for field, col in COLUMNS[reader].items()}
