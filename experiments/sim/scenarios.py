"""Named scenarios, the sweeps behind the figures, and the files they write.

Contract:
- `SCENARIOS[name](seed, bench)` builds a `Scenario`: a calibration (job + costs,
  each value sourced), a failure model, a horizon, a replacement policy, a checkpoint
  interval rule, and the scenario's own assumptions written out in words.
- `run_scenario(sc)` simulates every system against the *same* failure events and
  returns a `ScenarioResult`; `write_result(res, out)` writes out/summary.json (per
  system: tokens, effective throughput per wall second and per GPU-hour, ETTR, and
  the ratios of recover to checkpoint-restart) and out/timeseries.csv (per system:
  t_seconds, gpu_hours, tokens, effective_tokens, replicas) for the figures.
- Sweeps: `scale_sweep` (cluster size 512 .. 100k at Llama 3's failure rate) and
  `sensitivity` (paper-512's ratio against restart time, checkpoint interval and
  loss unit) write CSVs for paper_figs/.

What the ReCoVer paper does not state, and what paper-512 assumes instead (the
sensitivity sweep varies each): the replica size (taken as 32 GPUs, TP 8 x PP 4, so
256 lost GPUs are 8 replicas), the run length (40 minutes, so that 234 GPU-hours, the
paper's reported point, falls near the end of the run), the model and its iteration
time (about 8 s), the restart, checkpoint save and load times (calibration.py), and
the checkpoint interval (Young/Daly-optimal for the loss rate).
"""
from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .calibration import LLAMA3_GPU_MTBF_HOURS, Calibration, cluster_costs, local_calibration
from .engine import RunRecord, _interp_last
from .failures import FailureEvents, FailureModel
from .model import JobModel
from .policies import SYSTEMS, simulate_one
from .youngdaly import daly_interval, interval_iterations, young_interval

PAPER = {"effective_throughput_ratio": 2.23, "more_tokens_percent_at_gpu_hours": 74.9, "gpu_hours": 234.0,
         "source": "ReCoVer (arXiv 2605.11215), abstract: 512 GPUs, 256 lost spread across the run"}

ALL_SYSTEMS = tuple(SYSTEMS)


def _f(default, doc: str):
    return field(default=default, metadata={"help": doc})


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
    wait_for_replacement: bool = _f(False, "checkpoint-restart waits for the replacement before restarting")
    checkpoint_every: int | str = _f("young-daly", "iterations between checkpoints, or 'young-daly'")
    systems: tuple[str, ...] = _f(ALL_SYSTEMS, "systems to simulate")
    gpu_hour_mark: float | None = _f(None, "report tokens at this many GPU-hours (paper-512: 234)")
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
    checkpoint: dict[str, Any]  # mode, MTBF, Young and Daly intervals, K
    failures_drawn: int  # timed + step failures in the events
    skipped_faults: tuple[str, ...]  # plan faults the simulator does not model
    runtime_seconds: float  # wall time of the simulation itself


# ---- checkpoint interval ------------------------------------------------------------------
def checkpoint_plan(sc: Scenario) -> dict[str, Any]:
    """K (iterations between checkpoints) and how it was chosen."""
    job, costs = sc.calibration.job, sc.calibration.costs
    t_it = job.iteration_seconds(job.replicas)
    mtbf = sc.failures.job_mtbf_seconds(job, sc.horizon_seconds)
    out: dict[str, Any] = {"job_mtbf_seconds": mtbf, "checkpoint_save_seconds": costs.checkpoint_save_seconds,
                           "iteration_seconds": t_it}
    if math.isfinite(mtbf):
        out["young_seconds"] = young_interval(costs.checkpoint_save_seconds, mtbf)
        out["daly_seconds"] = daly_interval(costs.checkpoint_save_seconds, mtbf)
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
    runs = {}
    for system in sc.systems:
        runs[system] = simulate_one(
            system, sc.calibration.job, sc.calibration.costs, events, sc.horizon_seconds,
            max_iterations=sc.max_iterations, checkpoint_every=ck["interval_iterations"],
            replacement_delay=sc.replacement_for(system), wait_for_replacement=sc.wait_for_replacement,
            mtbf_seconds=ck["job_mtbf_seconds"])
    return ScenarioResult(sc, runs, ck, len(events), events.skipped, time.perf_counter() - t0)


def tokens_at_gpu_hours(run: RunRecord, mark: float) -> float | None:
    """Effective tokens when the run had used `mark` GPU-hours (None if it never did)."""
    s = run.series()
    if len(s["gpu_hours"]) == 0 or s["gpu_hours"][-1] < mark:
        return None
    return _interp_last(s["gpu_hours"], s["effective_tokens"], mark)


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
        d["effective_throughput_last_quarter_tokens_per_s"] = late_throughput(run, sc.horizon_seconds)
        if sc.gpu_hour_mark is not None:
            d["effective_tokens_at_gpu_hour_mark"] = tokens_at_gpu_hours(run, sc.gpu_hour_mark)
        if run.first_commit_at is not None and run.last_commit_at is not None and run.iterations > 1:
            d["first_commit_seconds"], d["last_commit_seconds"] = run.first_commit_at, run.last_commit_at
        systems[name] = d
    ratios: dict[str, Any] = {}
    if "recover" in systems and "checkpoint-restart" in systems:
        a, b = systems["recover"], systems["checkpoint-restart"]

        def ratio(key: str) -> float | None:
            x, y = a.get(key), b.get(key)
            if x is None or y is None or not y or (isinstance(y, float) and math.isnan(y)):
                return None
            return x / y
        ratios = {
            "effective_throughput": ratio("effective_throughput_tokens_per_s"),
            "effective_throughput_last_quarter": ratio("effective_throughput_last_quarter_tokens_per_s"),
            "effective_tokens_per_gpu_hour": ratio("effective_tokens_per_gpu_hour"),
            "ettr": ratio("ettr"),
        }
        if sc.gpu_hour_mark is not None:
            x, y = a.get("effective_tokens_at_gpu_hour_mark"), b.get("effective_tokens_at_gpu_hour_mark")
            ratios["gpu_hour_mark"] = sc.gpu_hour_mark
            ratios["more_tokens_percent_at_gpu_hour_mark"] = (100.0 * (x / y - 1)) if x and y else None
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
        "ratio_recover_over_checkpoint_restart": ratios,
        "assumptions": sc.assumptions or {},
        "calibration": {"name": sc.calibration.name, "values": sc.calibration.table()},
        "definitions": DEFINITIONS,
        "simulation_runtime_seconds": res.runtime_seconds,
    }
    if sc.name == "paper-512":
        out["paper"] = PAPER
    return out


DEFINITIONS = {
    "effective_tokens": "tokens of committed iterations kept at the end that processed exactly M microbatches "
                        "(the failure-free run's batch); shrunk-batch iterations count in tokens only",
    "exact_tokens": "effective tokens committed before the first shrunk-batch iteration",
    "effective_throughput_tokens_per_s": "effective tokens / wall seconds (the horizon, or the last commit when "
                                         "the run stops at max_iterations)",
    "effective_tokens_per_gpu_hour": "effective tokens / GPU-hours held (working, restarting or stalled; not dead)",
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


# ---- the named scenarios ---------------------------------------------------------------------
LOCAL_PLAN = (
    {"kind": "crash", "replica": 3, "step": 6, "phase": "backward"},
    {"kind": "crash", "replica": 2, "step": 13, "phase": "allreduce"},
)
"""The local default: lose half of the 4 replicas spread over a 20-step run, one of them
during the all-reduce (the same plan is given to the real runs it is compared with)."""


def local(seed: int = 0, bench: str | None = None, plan: tuple[dict, ...] | None = None,
          steps: int = 20, checkpoint_every: int = 5) -> Scenario:
    cal = local_calibration(bench)
    return Scenario(
        name="local", description="the validation set-up: 4 replicas, tiny model, M=8, this machine's costs",
        calibration=cal, failures=FailureModel("plan", plan=tuple(plan or LOCAL_PLAN), seed=seed),
        horizon_seconds=math.inf, max_iterations=steps,
        # Under TorchElastic a crashed worker is restarted by its node's agent: the group
        # re-forms at full size. The others go on without the replica.
        replacement_by_system={"elastic": 0.0, "elastic-shrink": 0.0},
        checkpoint_every=checkpoint_every,
        assumptions={"faults": "the plan's crash faults take a replica out (recover, torchft, checkpoint-restart "
                               "with the survivors); elastic restarts the crashed worker (its agent is alive)",
                     "checkpoint_every": f"{checkpoint_every} iterations (a real run's config wins in validation)"},
    )


def paper_512_job() -> tuple[JobModel, dict[str, str]]:
    job = JobModel(n_gpus=512, gpus_per_replica=32, microbatches=256, tokens_per_microbatch=2 * 2048,
                   microbatch_seconds=0.5, grad_bytes=7e9 * 2, link_bandwidth=25e9, link_latency=10e-6)
    src = {
        "n_gpus": "the paper: 512 GPUs",
        "gpus_per_replica": "assumed: TP 8 x PP 4 = 32 GPUs per model copy (the paper does not say); "
                            "256 lost GPUs = 8 replicas. See the sensitivity sweep over the loss unit",
        "microbatches": "assumed: 16 microbatches per replica (pipeline-friendly), M = 256",
        "tokens_per_microbatch": "assumed: 2 sequences of 2,048 tokens",
        "microbatch_seconds": "assumed: 0.5 s, an ~8 s iteration (a 7B-class model); not stated by the paper",
        "grad_bytes": "assumed: 7B parameters, bf16 gradients",
        "link_bandwidth": "assumed: 200 Gb/s per GPU",
        "link_latency": "assumed: 10 us per ring step",
        "cpu_slots": "not used at cluster scale",
    }
    return job, src


def paper_512(seed: int = 0, bench: str | None = None, restart: float | None = None,
              checkpoint_every: int | str = "young-daly", gpus_per_replica: int | None = None,
              horizon: float = 2400.0) -> Scenario:
    job, src = paper_512_job()
    if gpus_per_replica is not None and gpus_per_replica != job.gpus_per_replica:
        per = job.microbatches // job.replicas
        job = replace(job, gpus_per_replica=gpus_per_replica, microbatches=per * (512 // gpus_per_replica))
    costs, csrc = cluster_costs(job.n_gpus, job.gpus_per_replica)
    if restart is not None:
        costs = replace(costs, restart_seconds=restart)
        csrc["restart_seconds"] = f"sensitivity sweep: {restart} s"
    cal = Calibration("cluster-512", job, costs, {**src, **csrc})
    k = 256 // job.gpus_per_replica
    return Scenario(
        name="paper-512", description="512 GPUs, 256 of them lost evenly spread across the run, no replacement",
        calibration=cal, failures=FailureModel("spread", k_lost=k, seed=seed), horizon_seconds=horizon,
        replacement_delay=None, checkpoint_every=checkpoint_every, gpu_hour_mark=PAPER["gpu_hours"],
        assumptions={
            "losses": f"{k} replicas of {job.gpus_per_replica} GPUs lost at horizon*(i+1)/{k + 1} (the harness's "
                      "spread_losses): the paper's '256 GPUs lost spread across the run'",
            "horizon": f"{horizon:.0f} s: recover holds 512 GPUs falling to 256, about 384 on average, so it reaches "
                       "the paper's 234 GPU-hour point near the end; the paper's run length is not stated",
            "checkpoint-restart": "restarts with the survivors, the batch kept at M by accumulation (issue 5); "
                                  "Young/Daly interval for the loss rate",
            "unknown": "restart time, checkpoint cost and interval, replica size: see sensitivity/",
        },
    )


def llama3_job(n_gpus: int) -> tuple[JobModel, dict[str, str]]:
    """A Llama-3-405B-shaped job: 128 GPUs per replica (TP 8 x PP 16), 16 sequences of 8,192 tokens per replica."""
    gpr = 128
    r = n_gpus // gpr
    job = JobModel(n_gpus=n_gpus, gpus_per_replica=gpr, microbatches=16 * r, tokens_per_microbatch=8192,
                   microbatch_seconds=6.2 / 16, grad_bytes=405e9 * 2, link_bandwidth=50e9, link_latency=10e-6)
    src = {
        "n_gpus": f"{n_gpus} GPUs (the scenario)",
        "gpus_per_replica": "Llama 3 405B's layout at 16K GPUs: TP 8 x PP 16 = 128 GPUs per model copy (DP 128)",
        "microbatches": "Llama 3: 16 sequences per data-parallel replica (2,048 per batch at 16K GPUs, 16M tokens); "
                        "kept per replica at other sizes (weak scaling)",
        "tokens_per_microbatch": "Llama 3: 8,192-token sequences",
        "microbatch_seconds": "derived: 6 x 405e9 FLOP/token x 16.8M tokens at ~400 TFLOP/s per GPU on 16,384 GPUs "
                              "gives ~6.2 s per iteration, 16 microbatches",
        "grad_bytes": "405B parameters, bf16 gradients",
        "link_bandwidth": "assumed: 400 Gb/s per GPU",
        "link_latency": "assumed: 10 us per ring step",
        "cpu_slots": "not used at cluster scale",
    }
    return job, src


def _cluster(name: str, n_gpus: int, days: float, seed: int, description: str, replacement: float = 3600.0) -> Scenario:
    job, src = llama3_job(n_gpus)
    costs, csrc = cluster_costs(job.n_gpus, job.gpus_per_replica)
    return Scenario(
        name=name, description=description, calibration=Calibration(f"cluster-{n_gpus}", job, costs, {**src, **csrc}),
        failures=FailureModel("exponential", mtbf_hours=LLAMA3_GPU_MTBF_HOURS, seed=seed),
        horizon_seconds=days * 86400.0, replacement_delay=replacement, checkpoint_every="young-daly",
        assumptions={
            "failure rate": f"Llama 3's: 419 unexpected interruptions in 54 days on 16,384 GPUs, a per-GPU MTBF of "
                            f"{LLAMA3_GPU_MTBF_HOURS:,.0f} h, exponential (memoryless); one interruption = one "
                            "replica lost",
            "replacement": f"a failed replica is replaced after {replacement / 3600:.1f} h (assumed); recover and "
                           "torchft admit it at a step boundary, checkpoint-restart at its next restart, "
                           "elastic by one more restart",
            "scaling": "weak scaling: per-replica batch fixed, so the iteration time is the same at every size "
                       "(up to the all-reduce)",
        },
    )


def llama3_16k(seed: int = 0, bench: str | None = None) -> Scenario:
    return _cluster("llama3-16k", 16384, 54.0, seed, "16,384 GPUs for 54 days at Llama 3's failure rate")


def cluster_100k(seed: int = 0, bench: str | None = None) -> Scenario:
    return _cluster("100k", 100_000, 30.0, seed, "100,000 GPUs for 30 days at Llama 3's per-GPU failure rate")


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "local": local,
    "paper-512": paper_512,
    "llama3-16k": llama3_16k,
    "100k": cluster_100k,
}


# ---- sweeps ------------------------------------------------------------------------------------
SCALE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000)


def scale_sweep(seed: int = 0, days: float = 30.0, sizes=SCALE_SIZES, seeds: int = 1) -> list[dict[str, Any]]:
    """Effective throughput and ETTR per system against cluster size (Llama 3 rate, 30 days)."""
    rows = []
    for n in sizes:
        for s in range(seed, seed + seeds):
            res = run_scenario(_cluster(f"scale-{n}", n, days, s, f"{n} GPUs"))
            summ = summarize(res)
            for name, d in summ["systems"].items():
                rows.append({"gpus": n, "seed": s, "system": name,
                             "effective_throughput_vs_failure_free": d["effective_throughput_vs_failure_free"],
                             "effective_tokens_per_gpu_hour": d["effective_tokens_per_gpu_hour"],
                             "ettr": d["ettr"], "failures": d["failures"],
                             "restart_seconds": res.scenario.calibration.costs.restart_seconds,
                             "interval_iterations": res.checkpoint["interval_iterations"]})
    return rows


SENS_RESTARTS = (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
SENS_INTERVALS = ("young-daly", 2, 4, 8, 16, 32, 64, 128)
SENS_UNITS = (8, 16, 32, 64, 128)


def sensitivity(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """paper-512's recover/checkpoint-restart ratios against restart time x interval, and the loss unit."""
    grid = []
    for rs in SENS_RESTARTS:
        for k in SENS_INTERVALS:
            sc = paper_512(seed, restart=rs, checkpoint_every=k)
            sc = replace(sc, systems=("recover", "checkpoint-restart"))
            res = run_scenario(sc)
            r = summarize(res)["ratio_recover_over_checkpoint_restart"]
            grid.append({"restart_seconds": rs, "checkpoint_every": str(k),
                         "interval_iterations": res.checkpoint["interval_iterations"],
                         "interval_seconds": res.checkpoint["interval_iterations"] * res.checkpoint["iteration_seconds"],
                         "ratio_effective_throughput": r["effective_throughput"],
                         "ratio_last_quarter": r["effective_throughput_last_quarter"],
                         "more_tokens_percent_at_234": r.get("more_tokens_percent_at_gpu_hour_mark")})
    units = []
    for g in SENS_UNITS:
        sc = replace(paper_512(seed, gpus_per_replica=g), systems=("recover", "checkpoint-restart"))
        res = run_scenario(sc)
        r = summarize(res)["ratio_recover_over_checkpoint_restart"]
        units.append({"gpus_per_replica": g, "losses": 256 // g, "ratio_effective_throughput": r["effective_throughput"],
                      "ratio_last_quarter": r["effective_throughput_last_quarter"],
                      "more_tokens_percent_at_234": r.get("more_tokens_percent_at_gpu_hour_mark")})
    return {"restart_x_interval": grid, "loss_unit": units,
            "restart_matching_paper": restart_matching_ratio(PAPER["effective_throughput_ratio"], seed)}


def restart_matching_ratio(target: float, seed: int = 0) -> dict[str, Any]:
    """The checkpoint-restart restart time at which paper-512 gives `target` (bisection, Young/Daly interval)."""
    def ratio(rs: float) -> float:
        sc = replace(paper_512(seed, restart=rs), systems=("recover", "checkpoint-restart"))
        return summarize(run_scenario(sc))["ratio_recover_over_checkpoint_restart"]["effective_throughput"]
    lo, hi = 0.0, 2000.0
    if not ratio(lo) <= target <= ratio(hi):
        return {"target": target, "restart_seconds": None, "note": "target outside the ratio's range over 0-2000 s"}
    for _ in range(40):
        mid = (lo + hi) / 2
        if ratio(mid) < target:
            lo = mid
        else:
            hi = mid
    return {"target": target, "restart_seconds": (lo + hi) / 2}


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
