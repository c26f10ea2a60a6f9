"""Validation: the simulator against real runs of this machine, read through the results contract.

Contract:
- `find_runs(root)` finds run directories (config.json + metrics.jsonl + summary.json)
  under `root`, skipping results/sim and results/bench (realruns.py reads runs, for this
  module and for the local calibration's measurements).
- `measure(run)` computes, from metrics.jsonl alone, the quantities the simulator also
  reports: committed steps, tokens, effective tokens (steps whose ids (`step_ids_are`) are
  exactly that step's M ids, step*M .. step*M+M-1), and two effective throughputs:
    from_start:        effective tokens / wall_time of the last committed step
    after_first_step:  effective tokens of steps >= 1 / (last wall_time - step 0's wall_time)
  The second leaves out the launch (5 processes importing torch on 2 shared cores,
  the noisiest number here); the first keeps it. The target is within 10%.
- Timing: the failure-free runs among the compared ones (no fault plan, every step a full
  batch; their mean when a folder holds several) calibrate the iteration time and the launch of
  the runs of their shape in the same folder (a folder = a batch of runs measured together), since
  this shared machine's speed drifts between sessions (only numbers measured
  together compare); otherwise `recover bench` results or the values measured.py
  computes from the committed runs.
- Per-fault costs are calibrated leave-one-out, from the *other* compared runs of the
  same system in the same folder, never the run itself: a baseline's restart time from their events.jsonl
  restart records; recover's detection (fault fired -> detected_at) and rebuild
  (detected_at -> formed_at) from their faults.jsonl and events.jsonl; torchft's
  loss-to-next-commit from their quorum_change records; each the mean of their samples (a run's
  time is the sum of its recoveries, and torchft's are bimodal). Without such
  runs: `recover bench` results, or measured.py's (from the committed runs).
- Compute: when a folder also holds failure-free runs of 1 replica and of more, the compute
  model is measured at each replica count (`fit_compute`) instead of an even split of the
  machine's 2 cores.
- `simulate_like(run)` builds the local scenario from the run's own config.json
  (train: system, replicas, M, steps, batch and block size, its hang deadline;
  baseline: the BaselineConfig the run recorded, i.e. its checkpoint interval,
  elastic batch rule and restart mode) and its fault plan (DIR/fault_plan.json), and
  simulates that one system, named by its label (experiments.labels; plain's
  failure-free runs as recover); `compare(paths)` pairs both and states the error.
  A checkpointing run without baseline.ckpt_every falls back to the local
  scenario's interval, and the row says so.
- The local calibration measured the tiny model. A run of another size (config.json's "model"
  shape, `gpt_parameters`) has its checkpoint save, async-save stall and load scaled to its own
  state bytes (the bench measured bytes per second) and its all-reduce to its gradient's bytes.
- Each row says whether the run is within the tolerance after the first step
  (`within_tolerance`) and from the start (`within_tolerance_from_start`).
- Runs whose replicas have many ranks (config.json's train.shard x tp x pp > 1) are
  not simulated: the local calibration measured replicas of one process, and on
  this machine R x S processes share its cores. `compare` lists them under
  "not_simulated" with that reason (the key is there only when there are some).
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from recover.core.storage.results import step_ids_are
from recover.core.config.shapes import GPTConfig
from recover.experiments.labels import variant_label

from .calibration import local_calibration
from .measured import STATE_BYTES_PER_PARAMETER, TINY_PARAMETERS, gpt_parameters
from .realruns import (RealRun, _is_reference, _train, find_runs, load_run, recovery_samples,  # noqa: F401
                       reference_timing, restart_samples, torchft_samples)
from .failures import FailureEvents, events_from_plan
from .system_policies import CHECKPOINTING, SYSTEMS, simulate_one
from .named_scenarios import local

SIMULATED_AS_PLAIN = "recover"
"""plain has no fault tolerance: its (failure-free) runs are simulated as recover without faults."""

TOLERANCE = 0.10

LOCAL_ONE_RANK = ("replicas of many ranks: the local calibration measured replicas of one process, and here "
                  "R x S processes share the machine's cores")


def measure(run: RealRun) -> dict[str, Any]:
    """Steps, tokens and effective throughput from metrics.jsonl (see the module contract)."""
    M = int(_train(run)["microbatches"])
    eff_tokens, eff_after = 0.0, 0.0
    for m in run.metrics:
        s = int(m["step"])
        ok = step_ids_are(m, s * M, s * M + M)
        if ok:
            eff_tokens += m["tokens"]
            if s >= 1:
                eff_after += m["tokens"]
    if not run.metrics:
        return {"steps": 0, "tokens": 0, "effective_tokens": 0, "from_start": 0.0, "after_first_step": None}
    last = run.metrics[-1]["wall_time"]
    first = next((m["wall_time"] for m in run.metrics if m["step"] == 0), None)
    return {
        "steps": len(run.metrics), "tokens": sum(m["tokens"] for m in run.metrics), "effective_tokens": eff_tokens,
        "last_commit_seconds": last, "step0_seconds": first,
        "from_start": eff_tokens / last if last > 0 else 0.0,
        "after_first_step": eff_after / (last - first) if first is not None and last > first else None,
    }


def run_parameters(run: RealRun) -> int:
    """The run's model's trainable parameters, from its config.json "model" section (the tiny model's
    when a run recorded none)."""
    shape = run.config.get("model")
    # a field the run did not record has the model's default (core/config/shapes.py)
    return gpt_parameters({**asdict(GPTConfig()), **shape}) if shape else TINY_PARAMETERS


def model_scaled(costs, params: int):
    """`costs` with the checkpoint save, async-save stall and load scaled from the tiny model's state
    to `params` parameters' (the bench measured bytes per second: the cost is linear in the bytes)."""
    k = params / TINY_PARAMETERS
    return replace(costs, checkpoint_save_seconds=costs.checkpoint_save_seconds * k,
                   checkpoint_load_seconds=costs.checkpoint_load_seconds * k,
                   checkpoint_async_stall_seconds=costs.checkpoint_async_stall_seconds * k)


def fit_compute(step_seconds: dict[int, float], microbatches: int,
                allreduce) -> tuple[float, tuple[tuple[int, float], ...]] | None:
    """(one microbatch's seconds alone, the CPU slots the replicas effectively share at each measured
    replica count) from failure-free step times by replica count, or None without a 1-replica run
    and another.

    The model's step is ceil(M/R) x t_mb x max(1, R/c(R)) + allreduce(R). One replica shares nothing
    and all-reduces nothing: t_mb = step(1) / M. Each other count R then gives its own
    c(R) = ceil(M/R) x t_mb x R / (step(R) - allreduce(R)); the job interpolates between them
    (`JobModel.cpu_slots_at`). Measured on this machine's 2 cores, c comes out below 2, and lower
    with more processes: the coordinator, heartbeats and gloo's threads take their share too."""
    if 1 not in step_seconds or len(step_seconds) < 2:
        return None
    t = step_seconds[1] / microbatches
    slots = []
    for r, y in sorted(step_seconds.items()):
        if r >= 2 and y - allreduce(r) > 0:
            slots.append((r, max(1.0, -(-microbatches // r) * t * r / (y - allreduce(r)))))
    return (t, tuple(slots)) if slots else None


def simulate_like(run: RealRun, bench: str | None = None,
                  same_session: dict[str, tuple[float, str]] | None = None,
                  compute: dict[int, float] | None = None) -> tuple[str, dict[str, Any], list[str]]:
    """Simulate the run's own set-up; returns (simulated system, measures, notes). `compute`: failure-free
    step times by replica count measured in the run's batch (same M); with a 1-replica run among
    them they replace the compute model (`fit_compute`)."""
    tr = _train(run)
    notes: list[str] = []
    real_system = str(tr["system"])
    baseline = run.config.get("baseline") or {}
    system = SIMULATED_AS_PLAIN if real_system == "plain" else variant_label(real_system, baseline)
    if system not in SYSTEMS:
        raise ValueError(f"{run.path}: system {system!r} has no simulated counterpart; simulated: {', '.join(SYSTEMS)}")
    R, M, steps = int(tr["replicas"]), int(tr["microbatches"]), int(tr["steps"])
    block = int(tr.get("block_size") or run.config.get("model", {}).get("block_size", 64))
    cal = local_calibration(bench, replicas=R, microbatches=M, same_session=same_session)
    if same_session and "iteration_seconds" in same_session:
        notes.append("timing from " + same_session["iteration_seconds"][1])
    job = replace(cal.job, tokens_per_microbatch=int(tr.get("batch_size", 4)) * block)
    costs = cal.costs
    # The local calibration measured the tiny model: a run of another size saves, loads and all-reduces
    # its own bytes (the iteration time comes from the batch's failure-free run, whatever the size).
    params = run_parameters(run)
    if params != TINY_PARAMETERS:
        costs = model_scaled(costs, params)
        job = replace(job, grad_bytes=(params + 1) * 4)
        notes.append(f"checkpoint costs scaled to the run's model: {params:,} parameters x "
                     f"{STATE_BYTES_PER_PARAMETER} bytes (the tiny model's {TINY_PARAMETERS:,} measured)")
    fit = fit_compute(compute, M, job.allreduce_seconds) if compute else None
    if fit:
        job = replace(job, microbatch_seconds=fit[0], cpu_slots_at=fit[1])
        notes.append(f"compute from the batch's failure-free runs of {', '.join(map(str, sorted(compute)))} "
                     f"replicas: {fit[0] * 1e3:.1f} ms a microbatch alone, CPU slots shared "
                     + ", ".join(f"{c:.2f} at {r}" for r, c in fit[1]))
    if tr.get("heartbeat_timeout"):
        costs = replace(costs, hang_detect_seconds=float(tr["heartbeat_timeout"]))
    sc = local(steps=steps)
    k = baseline.get("ckpt_every")
    if k is None:
        k = sc.checkpoint_every
        if system in CHECKPOINTING:
            notes.append(f"config.json has no baseline.ckpt_every; assumed {k}")
    events = events_from_plan(run.plan) if run.plan else FailureEvents.none()
    notes.extend(events.skipped)
    replacement = sc.replacement_for(system)
    wait = False
    if real_system == "ckpt-restart" and baseline.get("restart_mode") == "replace":
        # the restart waits for a replacement replica, then runs at full size
        replacement, wait = float(baseline.get("replace_wait") or 0.0), True
    rec = simulate_one(system, job, costs, events, math.inf, max_iterations=steps,
                       checkpoint_every=int(k), replacement_delay=replacement, wait_for_replacement=wait)
    eff_after = rec.effective_tokens - (job.tokens_per_iteration if rec.effective_iterations else 0)
    last, first = rec.last_commit_at or 0.0, rec.step0_at
    return system, {
        "steps": rec.iterations, "tokens": rec.tokens, "effective_tokens": rec.effective_tokens,
        "last_commit_seconds": last, "step0_seconds": first,
        "from_start": rec.effective_tokens / last if last > 0 else 0.0,
        "after_first_step": eff_after / (last - first) if first is not None and last > first else None,
    }, notes


def mean_timing(timings: list[dict[str, tuple[float, str]]]) -> dict[str, tuple[float, str]]:
    """The mean of several failure-free runs' `reference_timing`s (one run: its own, unchanged)."""
    if len(timings) == 1:
        return timings[0]
    return {k: (sum(t[k][0] for t in timings) / len(timings),
                f"mean of {len(timings)} runs: " + "; ".join(t[k][1] for t in timings)) for k in timings[0]}


def _err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return sim / real - 1.0


def compare(paths: list[str | Path], bench: str | None = None, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """One row per real run: measured vs simulated effective throughput, and the relative error."""
    rows = []
    kept, loaded, not_simulated = [], [], []
    for p in paths:
        run = load_run(p)
        # the replica's processes: shard x tp x pp (a TP or PP replica is as many processes as a sharded one)
        shard = (int(_train(run).get("shard", 1) or 1) * int(_train(run).get("tp", 1) or 1)
                 * int(_train(run).get("pp", 1) or 1))
        if shard > 1:
            not_simulated.append({"run": str(p), "system": _train(run).get("system"), "shard": shard,
                                  "reason": LOCAL_ONE_RANK})
        else:
            kept.append(p)
            loaded.append(run)
    paths = kept
    # Failure-free runs measured in the same batch calibrate the iteration time and the launch of the
    # runs with the same shape (replicas, M): this machine is shared and its speed drifts between sessions.
    def shape(run: RealRun) -> tuple:
        # runs of one batch share a folder: only they were measured under the same load
        return run.path.parent, int(_train(run)["replicas"]), int(_train(run)["microbatches"])

    # A batch may hold several failure-free runs of one shape (one before and one after its faulty
    # runs, so that a drift of the machine's load during the batch shows): their mean is the timing.
    timings: dict[tuple, list[dict[str, tuple[float, str]]]] = {}
    ref_paths = set()
    for run in loaded:
        t = reference_timing(run) if _is_reference(run) else {}
        if t:
            timings.setdefault(shape(run), []).append(t)
            ref_paths.add(run.path)
    refs = {key: mean_timing(ts) for key, ts in timings.items()}
    # the failure-free step time of every replica count a batch measured (for `fit_compute`)
    steps_by_folder: dict[tuple, dict[int, float]] = {}
    for (folder, r, m), t in refs.items():
        steps_by_folder.setdefault((folder, m), {})[r] = t["iteration_seconds"][0]
    for i, (p, run) in enumerate(zip(paths, loaded)):
        real = measure(run)
        key = shape(run)
        session = dict(refs.get(key) or {})
        # Leave-one-out: a baseline's restart time comes from the *other* runs of the same system,
        # never from the run being validated.
        cal = local_calibration(bench, key[1], key[2], session or None)
        t_it = cal.job.iteration_seconds(key[1])
        name = str(_train(run).get("system"))
        others = [o for j, o in enumerate(loaded) if j != i and str(_train(o).get("system")) == name
                  and o.path.parent == run.path.parent]
        load = cal.costs.checkpoint_load_seconds * run_parameters(run) / TINY_PARAMETERS
        # The mean, not the median, of the other runs' samples: a run's time is the sum of its
        # recoveries, so the expected one is what the simulator must charge each. torchft's are
        # bimodal here (about 1 s by its heartbeat, or its 10 s collective timeout when a peer
        # died with the all-reduce pending), and a median charged every loss the short one.
        samples = [x for o in others for x in restart_samples(o, t_it, load)]
        loo_note = None
        where = ", ".join(str(o.path) for o in others)
        if samples:
            mean = sum(samples) / len(samples)
            src = f"mean of {len(samples)} restarts in other {name} runs ({where})"
            session["elastic_restart_seconds" if name == "elastic" else "restart_seconds"] = (mean, src)
            loo_note = f"restart time {mean:.2f} s: {src}"
        rec = [x for o in others for x in recovery_samples(o)] if name == "recover" else []
        if rec:
            src = f"mean of {len(rec)} recoveries in other recover runs ({where})"
            session["recover_detect_seconds"] = (sum(d for d, _ in rec) / len(rec), "detection: " + src)
            session["recover_rebuild_seconds"] = (sum(r for _, r in rec) / len(rec), "rebuild: " + src)
            loo_note = (f"recover detect {session['recover_detect_seconds'][0] * 1e3:.0f} ms, rebuild "
                        f"{session['recover_rebuild_seconds'][0] * 1e3:.0f} ms: {src}")
        ft = [x for o in others for x in torchft_samples(o)] if name == "torchft" else []
        if ft:
            src = f"mean of {len(ft)} quorum changes in other torchft runs ({where})"
            session["torchft_recovery_seconds"] = (sum(ft) / len(ft), src)
            loo_note = f"torchft loss-to-next-commit {sum(ft) / len(ft):.2f} s: {src}"
        system, sim, notes = simulate_like(run, bench, session or None, steps_by_folder.get((key[0], key[2])))
        if loo_note:
            notes.append(loo_note)
        e_start, e_after = _err(sim["from_start"], real["from_start"]), _err(sim["after_first_step"], real["after_first_step"])
        is_ref = run.path in ref_paths
        rows.append({
            "run": str(p), "system": _train(run).get("system"), "simulated_as": system,
            # the timing reference is fitted to itself: shown, never counted as validated
            "role": "timing reference" if is_ref else "validated",
            "faults": len((run.plan or {}).get("faults", [])), "status": run.summary.get("status"),
            "real": real, "sim": sim,
            "error_from_start": e_start, "error_after_first_step": e_after,
            "within_tolerance": (not is_ref) and e_after is not None and abs(e_after) <= tolerance,
            "within_tolerance_from_start": (not is_ref) and e_start is not None and abs(e_start) <= tolerance,
            "notes": notes,
        })
    ok = [r for r in rows if r["within_tolerance"]]
    checked = [r for r in rows if r["role"] == "validated"]
    # Pooled per system: all its validated runs' effective tokens after step 0 over their summed
    # windows, simulated against measured. Single restart-bound runs are noisy (their measured
    # restarts vary by tens of percent here); the pool shows whether the model is biased.
    pooled: dict[str, Any] = {}
    for name in sorted({r["simulated_as"] for r in checked}):
        rs = [r for r in checked if r["simulated_as"] == name]

        def rate(side: str) -> float | None:
            parts = [(r[side]["after_first_step"], r[side]["last_commit_seconds"] - r[side]["step0_seconds"])
                     for r in rs if r[side]["after_first_step"] is not None]
            window = sum(w for _, w in parts)
            return sum(x * w for x, w in parts) / window if window > 0 else None
        err = _err(rate("sim"), rate("real"))
        pooled[name] = {"runs": len(rs), "error": err, "within_tolerance": err is not None and abs(err) <= tolerance}
    extra = {"not_simulated": not_simulated} if not_simulated else {}
    return {
        **extra,
        "tolerance": tolerance,
        "metric": "effective throughput after the first committed step (tokens/s), simulated vs measured",
        "runs": rows,
        "validated": len(ok), "total": len(checked),
        "validated_from_start": sum(r["within_tolerance_from_start"] for r in checked),
        "pooled_by_system": pooled,
        "systems_within_tolerance": sorted({r["simulated_as"] for r in ok}),
        "systems_outside_tolerance": sorted({r["simulated_as"] for r in checked if not r["within_tolerance"]}),
    }
