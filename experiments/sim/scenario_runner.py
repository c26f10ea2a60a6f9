"""A scenario, what running it returns, and running it: every system against the same failures.

Contract:
- `Scenario` is one simulated set-up: a calibration (job + costs, each value
  sourced), a failure model, a horizon, a replacement policy, a checkpoint interval
  rule, the systems to run (labels of system_policies.SYSTEMS), published numbers it is
  compared with, and its own assumptions written out in words. The named ones are in
  named_scenarios.py.
- `checkpoint_plan(sc, system)` is the interval a checkpointing system uses: fixed, or
  Daly's optimum (youngdaly.py) for the scenario's expected failure rate and that
  system's stall per save (a blocking save, or an async save's snapshot: the
  `ckpt_async` setting of its variant), as a competent user would set it.
- `Scenario.comparator` names the checkpointing baseline the headline ratio
  (summary.json's ratio_recover_over_ckpt_restart) is taken against.
- `run_scenario(sc)` draws the failure events once and simulates every system of
  `sc` against the *same* events; it returns a `ScenarioResult` (reports in
  report.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from recover.core.config.fields import doc_field as _f

from .calibration import Calibration
from .costs import save_stall_seconds
from .failures import FailureEvents, FailureModel
from .system_policies import CHECKPOINTING, SYSTEMS, simulate_one
from .record import RunRecord
from .youngdaly import daly_interval, interval_iterations, young_interval

ALL_SYSTEMS = tuple(SYSTEMS)


@dataclass(frozen=True)
class Scenario:
    """One simulated set-up, run for every system against the same failures."""

    name: str = _f("", "scenario name")
    description: str = _f("", "one line: what it is")
    calibration: Calibration = _f(None, "job model + costs + their sources")
    failures: FailureModel = _f(FailureModel(), "how failures are drawn")
    horizon_seconds: float = _f(3600.0, "wall time simulated (inf: until max_iterations)")
    max_iterations: int | None = _f(None, "stop after this many committed iterations (None: horizon only)")
    replacement_delay: float | None = _f(None, "seconds until a failed replica is replaced (None: never)")
    replacement_by_system: dict[str, float | None] = _f(None, "per-system override of replacement_delay")
    wait_for_replacement: bool = _f(False, "ckpt-restart waits for the replacement before restarting")
    checkpoint_every: int | str = _f("young-daly", "iterations between checkpoints, or 'young-daly'")
    systems: tuple[str, ...] = _f(ALL_SYSTEMS, "systems to simulate")
    comparator: str = _f("ckpt-restart", "the checkpointing baseline recover's headline ratio is taken against")
    gpu_hour_mark: float | None = _f(None, "report tokens at this many GPU-hours (paper-512: 234)")
    published: dict[str, Any] = _f(None, "published numbers this scenario is compared with (paper-512: the paper's)")
    assumptions: dict[str, str] = _f(None, "what the scenario assumes, in words")

    def replacement_for(self, system: str) -> float | None:
        if self.replacement_by_system and system in self.replacement_by_system:
            return self.replacement_by_system[system]
        return self.replacement_delay


@dataclass
class ScenarioResult:
    """Every system's record for one scenario, and how the checkpoint interval was chosen."""

    scenario: Scenario  # what was run
    runs: dict[str, RunRecord]  # system -> its record
    checkpoint: dict[str, Any]  # the comparator's plan: mode, MTBF, Young and Daly intervals, K; by_system: K each
    failures_drawn: int  # timed + step failures in the events
    skipped_faults: tuple[str, ...]  # plan faults the simulator does not model
    runtime_seconds: float  # wall time of the simulation itself


# ---- checkpoint interval ------------------------------------------------------------------
def checkpoint_plan(sc: Scenario, system: str | None = None) -> dict[str, Any]:
    """K (iterations between checkpoints) for `system` (default: the scenario's comparator) and how
    it was chosen."""
    job, costs = sc.calibration.job, sc.calibration.costs
    system = system or sc.comparator
    t_it = job.iteration_seconds(job.replicas)
    mtbf = sc.failures.job_mtbf_seconds(job, sc.horizon_seconds)
    asynchronous = bool(SYSTEMS[system][2].get("ckpt_async", False)) if system in SYSTEMS else False
    stall = save_stall_seconds(costs, asynchronous)  # what a checkpoint costs the run, blocking or async
    out: dict[str, Any] = {"system": system, "job_mtbf_seconds": mtbf,
                           "checkpoint_save_seconds": costs.checkpoint_save_seconds,
                           "checkpoint_stall_seconds": stall, "iteration_seconds": t_it}
    if math.isfinite(mtbf):
        out["young_seconds"] = young_interval(stall, mtbf)
        out["daly_seconds"] = daly_interval(stall, mtbf)
    if sc.checkpoint_every == "young-daly":
        out["mode"] = "young-daly (Daly's formula, rounded to whole iterations)"
        if math.isfinite(mtbf):
            out["interval_iterations"] = interval_iterations(out["daly_seconds"], t_it)
        else:  # no failure expected: checkpoint hourly, as a job without failures data would
            out["interval_iterations"] = interval_iterations(3600.0, t_it)
            out["mode"] += "; no failure rate known, hourly"
    else:
        out["mode"] = "fixed"
        out["interval_iterations"] = int(sc.checkpoint_every)
    return out


# ---- running ----------------------------------------------------------------------------------
def draw_events(sc: Scenario) -> FailureEvents:
    renewal = sc.replacement_delay is not None or any(
        v is not None for v in (sc.replacement_by_system or {}).values())
    return sc.failures.sample(sc.calibration.job, sc.horizon_seconds, renewal=renewal)


def run_scenario(sc: Scenario, events: FailureEvents | None = None) -> ScenarioResult:
    """Simulate every system of `sc` against the same failure events."""
    t0 = time.perf_counter()
    if events is None:
        events = draw_events(sc)
    ck = checkpoint_plan(sc)
    plans = {s: checkpoint_plan(sc, s) for s in sc.systems}
    ck["by_system"] = {s: p["interval_iterations"] for s, p in plans.items() if s in CHECKPOINTING}
    runs = {}
    for system in sc.systems:
        runs[system] = simulate_one(
            system, sc.calibration.job, sc.calibration.costs, events, sc.horizon_seconds,
            max_iterations=sc.max_iterations, checkpoint_every=plans[system]["interval_iterations"],
            replacement_delay=sc.replacement_for(system), wait_for_replacement=sc.wait_for_replacement,
            mtbf_seconds=ck["job_mtbf_seconds"])
    return ScenarioResult(sc, runs, ck, len(events), events.skipped, time.perf_counter() - t0)
