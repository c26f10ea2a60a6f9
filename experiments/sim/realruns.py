"""Real runs as the simulator reads them: the results contract of one run, and the costs it shows.

Contract:
- `find_runs(root)` finds run directories (config.json + metrics.jsonl + summary.json)
  under `root`, skipping results/sim and results/bench (unless root is inside them);
  `load_run(path)` reads one into a `RealRun`.
- Samples of what a run paid, as the simulator's Costs mean them (each from the run's
  own files, nothing typed in):
  `reference_timing` (a failure-free run: median step-to-step time, step 0's wall time),
  `restart_samples` (a checkpointing baseline's restarts, events.jsonl, detected to the
  first commit after it, minus that committing step and the load), `torchft_samples` (torchft's loss to next
  commit, its quorum_change records), `recovery_samples` (recover: fault fired ->
  detected_at -> formed_at, faults.jsonl and events.jsonl).
Both validation.py (comparing runs with their simulation) and measured.py (the local
calibration's measurements) read runs through this module.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from recover.core.storage.results import read_jsonl, read_metrics, step_ids_are


@dataclass
class RealRun:
    """One real run directory, as the results contract has it."""

    path: Path  # the run's --out directory
    config: dict  # config.json
    metrics: list[dict]  # metrics.jsonl, in step order
    summary: dict  # summary.json
    plan: dict | None  # fault_plan.json (None: no faults)


def find_runs(root: str | Path) -> list[Path]:
    root = Path(root)
    if (root / "metrics.jsonl").is_file():
        return [root]
    out = []
    for m in sorted(root.rglob("metrics.jsonl")):
        d = m.parent
        rel = d.relative_to(root).parts
        if "sim" in rel or "bench" in rel:  # the simulator's own outputs and benchmark files
            continue
        if (d / "config.json").is_file() and (d / "summary.json").is_file():
            out.append(d)
    return out


def load_run(path: str | Path) -> RealRun:
    p = Path(path)
    plan = None
    if (p / "fault_plan.json").is_file():
        plan = json.loads((p / "fault_plan.json").read_text())
    return RealRun(p, json.loads((p / "config.json").read_text()), read_metrics(p / "metrics.jsonl"),
                   json.loads((p / "summary.json").read_text()), plan)


def _train(run: RealRun) -> dict:
    return run.config.get("train", run.config)


def reference_timing(run: RealRun) -> dict[str, tuple[float, str]]:
    """A failure-free run's median step-to-step time and its step-0 wall time (the launch)."""
    w = [m["wall_time"] for m in run.metrics]
    gaps = sorted(b - a for a, b in zip(w, w[1:]))
    if not gaps:
        return {}
    return {"iteration_seconds": (gaps[len(gaps) // 2], f"median step time of the failure-free run {run.path}"),
            "startup_seconds": (w[0], f"step 0's wall_time in the failure-free run {run.path}")}


def restart_samples(run: RealRun, iteration_seconds: float, load_seconds: float) -> list[float]:
    """Restart costs seen in a run's events.jsonl, as the simulator's restart_seconds means them:
    the record's restart_seconds (detected -> the first commit after the restart, which is the
    checkpoint's next step: the lost steps are redone after it) minus that committing step and
    the load."""
    out = []
    for e in read_jsonl(run.path / "events.jsonl"):
        if e.get("kind") == "restart" and isinstance(e.get("restart_seconds"), (int, float)):
            out.append(max(0.0, e["restart_seconds"] - iteration_seconds - load_seconds))
    return out


def torchft_samples(run: RealRun) -> list[float]:
    """Seconds from a detected loss to the next committed step, from a torchft run's quorum changes."""
    return [float(e["restart_seconds"]) for e in read_jsonl(run.path / "events.jsonl")
            if e.get("kind") == "quorum_change" and e.get("lost_replicas")
            and isinstance(e.get("restart_seconds"), (int, float))]


def recovery_samples(run: RealRun) -> list[tuple[float, float]]:
    """(detect, rebuild) seconds of each recovery in a recover run: the fault's firing (faults.jsonl)
    to detected_at, and detected_at to formed_at (events.jsonl)."""
    fired: dict[int, float] = {}
    for f in read_jsonl(run.path / "faults.jsonl"):
        if f.get("step") is not None and isinstance(f.get("wall_time"), (int, float)):
            fired[int(f["step"])] = min(fired.get(int(f["step"]), math.inf), float(f["wall_time"]))
    out = []
    for e in read_jsonl(run.path / "events.jsonl"):
        if e.get("kind") == "recovery" and e.get("step") in fired and "formed_at" in e:
            out.append((max(0.0, e["detected_at"] - fired[e["step"]]), max(0.0, e["formed_at"] - e["detected_at"])))
    return out


def _is_reference(run: RealRun) -> bool:
    return not (run.plan or {}).get("faults") and all(
        step_ids_are(m, m["step"] * int(_train(run)["microbatches"]), (m["step"] + 1) * int(_train(run)["microbatches"]))
        for m in run.metrics)
