"""What a scenario's run reports: summary.json, timeseries.csv, and the sweeps' CSV rows.

Contract:
- `summarize(res)` is the summary.json object: per system (its label) the RunRecord's
  numbers (record.py defines them; DEFINITIONS says them in words in the file
  itself), effective throughput against the failure-free job, tokens at the
  scenario's GPU-hour mark, the ratios of recover to the scenario's comparator
  (ratio_recover_over_ckpt_restart, the headline) and to every checkpointing baseline
  (ratio_recover_over); the
  scenario's failure model, checkpoint plan, calibration with every value's source,
  assumptions and published numbers.
- `write_result(res, out)` writes out/summary.json and out/timeseries.csv (per
  system: t_seconds, gpu_hours, tokens, effective_tokens, replicas; at most
  max_points rows per system, the first and last always kept) for the figures.
- `write_rows(rows, path)` writes a sweep's rows as CSV (floats to 6 digits).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .record import THROUGHPUT_METRICS, RunRecord, interp_last
from .system_policies import CHECKPOINTING
from .scenario_runner import ScenarioResult


def tokens_at_gpu_hours(run: RunRecord, mark: float) -> float | None:
    """Effective tokens when the run had used `mark` GPU-hours (None if it never did)."""
    s = run.series()
    if len(s["gpu_hours"]) == 0 or s["gpu_hours"][-1] < mark:
        return None
    return interp_last(s["gpu_hours"], s["effective_tokens"], mark)


def late_throughput(run: RunRecord, horizon: float, fraction: float = 0.25) -> float:
    """Effective tokens per second over the last `fraction` of the horizon (after most failures)."""
    if not math.isfinite(horizon):
        return float("nan")
    a = horizon * (1 - fraction)
    return (run.effective_tokens_at(horizon) - run.effective_tokens_at(a)) / (horizon - a)


def summarize(res: ScenarioResult) -> dict[str, Any]:
    """The summary.json object."""
    sc = res.scenario
    job = sc.calibration.job
    t_it = job.iteration_seconds(job.replicas)
    ff_tput = job.failure_free_throughput()
    systems: dict[str, Any] = {}
    for name, run in res.runs.items():
        d = run.summary()
        d["effective_throughput_vs_failure_free"] = d["effective_throughput_tokens_per_s"] / ff_tput
        d["goodput_vs_failure_free"] = d["goodput_tokens_per_s"] / ff_tput
        d["effective_throughput_last_quarter_tokens_per_s"] = late_throughput(run, sc.horizon_seconds)
        if sc.gpu_hour_mark is not None:
            d["effective_tokens_at_gpu_hour_mark"] = tokens_at_gpu_hours(run, sc.gpu_hour_mark)
        if run.first_commit_at is not None and run.last_commit_at is not None and run.iterations > 1:
            d["first_commit_seconds"], d["last_commit_seconds"] = run.first_commit_at, run.last_commit_at
        systems[name] = d
    ratios = _ratios(systems, sc.comparator, sc.gpu_hour_mark)
    out = {
        "scenario": sc.name,
        "description": sc.description,
        "seed": sc.failures.seed,
        "horizon_seconds": sc.horizon_seconds if math.isfinite(sc.horizon_seconds) else None,
        "max_iterations": sc.max_iterations,
        "failure_model": {k: v for k, v in asdict(sc.failures).items() if k != "plan"} | (
            {"plan": list(sc.failures.plan)} if sc.failures.plan else {}),
        "failures_drawn": res.failures_drawn,
        "skipped_faults": list(res.skipped_faults),
        "replacement_delay_seconds": sc.replacement_delay,
        "replacement_by_system": sc.replacement_by_system or {},
        "checkpoint": res.checkpoint,
        "failure_free": {"replicas": job.replicas, "gpus": job.gpus_used, "iteration_seconds": t_it,
                         "tokens_per_iteration": job.tokens_per_iteration,
                         "throughput_tokens_per_s": ff_tput,
                         "tokens_per_gpu_hour": ff_tput * 3600.0 / job.gpus_used},
        "systems": systems,
        "comparator": sc.comparator,
        "ratio_recover_over_ckpt_restart": ratios,
        "ratio_recover_over": {name: _ratios(systems, name, sc.gpu_hour_mark) for name in systems
                               if name in CHECKPOINTING},
        "assumptions": sc.assumptions or {},
        "calibration": {"name": sc.calibration.name, "values": sc.calibration.table()},
        "definitions": DEFINITIONS,
        "simulation_runtime_seconds": res.runtime_seconds,
    }
    if sc.published:
        out["paper"] = sc.published
    return out


def _ratios(systems: dict[str, Any], baseline: str, mark: float | None) -> dict[str, Any]:
    """recover's numbers over `baseline`'s ({} when either was not simulated)."""
    ratios: dict[str, Any] = {}
    if "recover" in systems and baseline in systems:
        a, b = systems["recover"], systems[baseline]

        def ratio(key: str) -> float | None:
            x, y = a.get(key), b.get(key)
            if x is None or y is None or not y or (isinstance(y, float) and math.isnan(y)):
                return None
            return x / y
        ratios = {
            "goodput": ratio("goodput_tokens_per_s"),
            "goodput_per_gpu_hour": ratio("goodput_tokens_per_gpu_hour"),
            "effective_throughput": ratio("effective_throughput_tokens_per_s"),
            "effective_throughput_last_quarter": ratio("effective_throughput_last_quarter_tokens_per_s"),
            "effective_tokens_per_gpu_hour": ratio("effective_tokens_per_gpu_hour"),
            "ettr": ratio("ettr"),
        }
        if mark is not None:
            x, y = a.get("effective_tokens_at_gpu_hour_mark"), b.get("effective_tokens_at_gpu_hour_mark")
            ratios["gpu_hour_mark"] = mark
            ratios["more_tokens_percent_at_gpu_hour_mark"] = (100.0 * (x / y - 1)) if x and y else None
    return ratios


DEFINITIONS = {
    "throughput_metrics": THROUGHPUT_METRICS,
    "effective_tokens": "tokens of committed iterations kept at the end that processed exactly M microbatches "
                        "(the failure-free run's batch); shrunk-batch iterations count in tokens only",
    "exact_tokens": "effective tokens committed before the first shrunk-batch iteration",
    "wall_seconds": "the horizon, or the last commit when the run stops at max_iterations (the denominator of "
                    "both throughput metrics per second)",
    "gpu_hours": "GPU-hours held: working, restarting or stalled; not dead (the denominator per GPU-hour)",
    "ettr": "failure-free duration of every kept effective iteration (at its replica count) / wall seconds",
    "effective_throughput_last_quarter_tokens_per_s": "effective tokens gained in the last 25% of the horizon "
                                                      "per second: the rate after most failures happened",
}


def write_result(res: ScenarioResult, out: str | Path, max_points: int = 600) -> dict[str, Any]:
    """out/summary.json and out/timeseries.csv; returns the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(res)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    with open(out / "timeseries.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "t_seconds", "gpu_hours", "tokens", "effective_tokens", "replicas"])
        for name, run in res.runs.items():
            s = run.series()
            idx = _thin(len(s["t"]), max_points)
            for i in idx:
                w.writerow([name, f"{s['t'][i]:.6g}", f"{s['gpu_hours'][i]:.6g}", f"{s['tokens'][i]:.8g}",
                            f"{s['effective_tokens'][i]:.8g}", int(s["replicas"][i])])
    return summary


def _thin(n: int, k: int) -> np.ndarray:
    """At most k indices of n, evenly spread, always keeping the first and the last."""
    if n <= k:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(int))


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o)}")


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
