"""Calibration: every cost the simulator charges, each with where its value comes from.

Contract:
- `Costs` (costs.py) holds the per-event costs of every system (seconds); `Calibration` pairs
  it with a `JobModel` and a `sources` map that names, for every field of both, the
  measurement or publication it comes from, or says "assumed" and why. Nothing
  enters the simulator without a source string; `Calibration.table()` lists them.
- `local_calibration()` is the tiny model on this machine: values measured here and
  computed by code from the committed runs and benches (measured.py: no measured number is
  typed in), overridden by what `recover bench` wrote to results/bench/
  when it exists: its recovery_<system>.json files, and a flat calibration.json
  (schema: BENCH_KEYS below; every key optional) that wins over both.
- `cluster_costs(n_gpus, gpus_per_replica, bench)` scales the restart-like costs with the
  cluster size by a power law (`restart_law`) through two anchors: the restart derived by
  code from the committed results/bench/recovery_ckpt-restart.json, and FT-HSDP's published
  one. Detection, rebuild and torchft's recovery come from the same bench files; no measured
  value is typed in for cluster scale. This is an assumption, stated as one; the sensitivity sweep
  (sweeps.sensitivity) shows how the headline ratio moves with it.

Published figures used (cited, not copied):
- Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024): 419 unexpected
  interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs. One
  interruption is taken as one replica lost, so the per-GPU MTBF is
  54 * 24 * 16384 / 419 = 50,677 hours (LLAMA3_GPU_MTBF_HOURS).
- FT-HSDP: a synchronous restart of a 100,000-GPU job stalls about 10 minutes
  (600 s at 100k GPUs: the large anchor of `restart_seconds`).
- TorchElastic's c10d rendezvous waits a last-call timeout of 30 s by default before
  a smaller group is formed (measured here: about 42 s to re-form with fewer nodes).
- Young (1974) and Daly (2006) for the optimal checkpoint interval (youngdaly.py).
- `coordinator_law(bench)`: the coordinator's cost per commit against the replica count R,
  fitted by code (least squares, a + b R: the service is O(R) per step) to the committed
  results/bench/coordinator_service.json (`recover bench coordinator --service`: the real
  service, real connections, last vote read -> commits sent). Charged per iteration at
  cluster scale (`recover_commit_seconds`); locally it is already inside the measured
  iteration time, so it is 0 there.
The ReCoVer paper does not state its restart time, checkpoint cost or interval,
replica size, or run length; named_scenarios.py says what is assumed for each.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from recover.core.config.fields import doc_field as _f

from .costs import Costs
from .failures import FailureEvents
from .measured import LOCAL_CPU_SLOTS, LOOPBACK_BANDWIDTH, TINY_GRAD_BYTES, Measured, local_measured
from .model import JobModel
from .system_policies import (BASELINE_HEARTBEAT_TIMEOUT_MS, BASELINE_LAST_CALL_S, UPSTREAM_HEARTBEAT_TIMEOUT_MS,
                       UPSTREAM_LAST_CALL_S, simulate_one)

LLAMA3_GPU_MTBF_HOURS = 54 * 24 * 16384 / 419
"""Per-GPU mean time between failures implied by Llama 3's 419 interruptions in 54 days on 16,384 GPUs."""


@dataclass(frozen=True)
class Calibration:
    """A named parameter set: the job, the costs, and the source of every value."""

    name: str = _f("", "the set's name")
    job: JobModel = _f(JobModel(), "the iteration-time model")
    costs: Costs = _f(Costs(), "per-event costs")
    sources: dict[str, str] = _f(None, "field name -> where its value comes from")

    def table(self) -> list[dict[str, Any]]:
        """One row per value: name, value, source (what summary.json records)."""
        rows = []
        for obj in (self.job, self.costs):
            for f in fields(obj):
                if f.metadata.get("table") is False:  # not a value (JobModel.layout)
                    continue
                rows.append({"name": f.name, "value": getattr(obj, f.name), "doc": f.metadata.get("help", ""),
                             "source": (self.sources or {}).get(f.name, "assumed (no source recorded)")})
        return rows


# ---- the local machine ----------------------------------------------------------------
# The tiny model on this machine (2 CPU cores, torch 2.13 CPU, gloo over loopback), M=8, 4
# sequences x 64 tokens per microbatch: every measured value is computed by measured.py from
# the committed runs (results/sim/real) and benches (results/bench), with its source.

BENCH_KEYS: dict[str, str] = {
    "iteration_seconds": "failure-free iteration, tiny model, 4 replicas, M=8 (recover or plain)",
    "recovery_seconds_p50": "recover: faulted iteration minus the median failure-free one",
    "restart_seconds": "ckpt-restart: fault to workers running again, without the checkpoint load",
    "checkpoint_save_seconds": "blocking checkpoint save",
    "checkpoint_load_seconds": "checkpoint load",
    "elastic_restart_seconds": "elastic: fault to workers running again, without the checkpoint load",
    "torchft_recovery_seconds": "torchft: kill to the next committed step",
    "startup_seconds": "launch to the first committed step",
}
"""results/bench/calibration.json: a flat JSON object, any subset of these keys (seconds),
plus an optional "source" string naming the command that produced it. It wins over
everything else."""

BENCH_SYSTEMS = {"recover": "recover", "ckpt-restart": "ckpt", "elastic": "elastic", "torchft": "torchft"}
"""results/bench/recovery_<system>.json files (written by `recover bench recovery --system NAME`)
read when present: their p50s become the keys below (see `load_bench`)."""

DEFAULT_BENCH_DIR = Path("results/bench")

Bench = dict[str, tuple[float, str]]
"""key -> (value, source)"""


def _p50(d: dict, key: str) -> float | None:
    v = d.get(key)
    if isinstance(v, dict):
        v = v.get("p50")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def load_bench(where: str | Path | None = None) -> Bench:
    """Values measured by `recover bench` in `where` (a directory, default results/bench, or a
    calibration.json file). From recovery_<system>.json: recover's recovery_overhead_s p50
    (recovery_seconds_p50) and failure-free iteration (iteration_seconds); each baseline's
    kill_to_next_commit_s and work_lost_microbatches p50s and its M (<tag>_kill_to_commit,
    <tag>_lost_microbatches, <tag>_microbatches; tag ckpt, elastic) and torchft's
    kill_to_next_commit_s (torchft_recovery_seconds). calibration.json's keys override.
    Unknown keys are ignored, bad values rejected; nothing there gives {}."""
    p = Path(where) if where is not None else DEFAULT_BENCH_DIR
    files = [p] if p.is_file() else []
    out: Bench = {}
    if p.is_dir():
        for system, tag in BENCH_SYSTEMS.items():
            f = p / f"recovery_{system}.json"
            if not f.is_file():
                continue
            d = json.loads(f.read_text())
            src = f"`{d.get('command') or 'recover bench recovery --system ' + system}` ({f})"
            if tag == "recover":
                v = _p50(d, "recovery_overhead_s")
                if v is not None:
                    out["recovery_seconds_p50"] = (v, src + ": recovery_overhead_s p50")
                ff = d.get("failure_free_iteration_s") or {}
                it = ff.get("recover", ff.get("plain")) if isinstance(ff, dict) else None
                if isinstance(it, (int, float)) and d.get("replicas") == 4 and d.get("microbatches") == 8:
                    out["iteration_seconds"] = (float(it), src + ": failure_free_iteration_s")
            elif tag == "torchft":
                v = _p50(d, "kill_to_next_commit_s")
                if v is not None:
                    out["torchft_recovery_seconds"] = (v, src + ": kill_to_next_commit_s p50")
            else:
                k, lost = _p50(d, "kill_to_next_commit_s"), _p50(d, "work_lost_microbatches")
                if k is not None and lost is not None and d.get("microbatches"):
                    out[f"{tag}_kill_to_commit"] = (k, src + ": kill_to_next_commit_s p50")
                    out[f"{tag}_lost_microbatches"] = (lost, src + ": work_lost_microbatches p50")
                    out[f"{tag}_microbatches"] = (float(d["microbatches"]), src)
        files = [p / "calibration.json"] if (p / "calibration.json").is_file() else []
    for f in files:
        raw = json.loads(f.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{f}: expected a JSON object")
        src = str(raw.get("source", f"`recover bench` ({f})"))
        for k in BENCH_KEYS:
            if k in raw:
                v = raw[k]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"{f}: {k} must be a number >= 0, got {v!r}")
                out[k] = (float(v), f"{src}: {k}")
    return out


def _redo_mean(job: JobModel) -> float:
    """Mean extra time recover's in-step redo adds to a faulted iteration, for a crash at a
    uniformly random point of the iteration and no detection or rebuild cost: used to turn the
    bench's recovery overhead (which includes the redo) into detection + rebuild without
    counting the redo twice. Computed with the simulator's own recover policy."""
    if job.replicas < 2:
        return 0.0
    t_it = job.iteration_seconds(job.replicas)
    zero = Costs()
    zero = replace(zero, recover_detect_seconds=0.0, recover_rebuild_seconds=0.0, startup_seconds=0.0)
    n, total = 32, 0.0
    for i in range(n):
        tau = (i + 0.5) / n * t_it
        res = simulate_one("recover", job, zero, FailureEvents.single(tau, 0), horizon=float("inf"),
                           max_iterations=1)
        total += res.wall_seconds - t_it
    return max(0.0, total / n)


def local_calibration(bench: str | Path | None = None, replicas: int = 4, microbatches: int = 8,
                      same_session: Bench | None = None, real: str | Path | None = None,
                      measured: Measured | None = None) -> Calibration:
    """The tiny model on this machine: the values measured.py computes from the committed runs under
    `real` (default results/sim/real; or `measured`, already computed), overridden by `recover bench`
    results if present, and those by `same_session` (iteration_seconds and startup_seconds of a
    failure-free run measured beside the runs being validated, for this replicas/microbatches: on a
    shared, noisy machine only numbers measured together compare)."""
    measured = measured if measured is not None else local_measured(real, bench)
    meas = {k: v for k, (v, _) in measured.items()}
    src = {k: s for k, (_, s) in measured.items()}
    b = load_bench(bench)
    b.update(same_session or {})
    sources: dict[str, str] = {}

    # The all-reduce: bandwidth assumed, latency fitted to the 2-replica measurement.
    lat = (meas["allreduce2_seconds"] - TINY_GRAD_BYTES / LOOPBACK_BANDWIDTH) / 2
    job = JobModel(n_gpus=replicas, gpus_per_replica=1, microbatches=microbatches, tokens_per_microbatch=4 * 64,
                   microbatch_seconds=meas["microbatch_seconds"], grad_bytes=TINY_GRAD_BYTES,
                   link_bandwidth=LOOPBACK_BANDWIDTH, link_latency=lat, cpu_slots=LOCAL_CPU_SLOTS)
    sources.update({
        "n_gpus": "the local scenario: one worker process (one 'GPU') per replica",
        "gpus_per_replica": "plain data parallelism: a replica is one process",
        "microbatches": "the local scenario's M (recover train default 8)",
        "tokens_per_microbatch": "recover train defaults: --batch-size 4 x block 64 tokens",
        "grad_bytes": "the tiny model: 119,104 fp32 parameters + the loss slot (core/training/workload.py)",
        "link_bandwidth": "assumed (loopback); the fitted latency dominates at this size",
        "link_latency": "fitted: " + src["allreduce2_seconds"],
        "cpu_slots": "this machine has 2 CPU cores, shared by the replicas' processes",
        "microbatch_seconds": src["microbatch_seconds"],
    })
    # Pin the 4-replica, M=8 iteration to its direct measurement (bench first): the compute
    # term absorbs the difference, since that is where contention on 2 cores shows.
    it, it_src = b.get("iteration_seconds", (meas["iteration_seconds"], src["iteration_seconds"]))
    if (replicas == 4 and microbatches == 8) or "iteration_seconds" in (same_session or {}):
        r = job.replicas
        share = r / job.cpu_slots if r > job.cpu_slots else 1.0
        per = (it - job.allreduce_seconds(r)) / (-(-microbatches // r)) / share
        job = replace(job, microbatch_seconds=per)
        sources["microbatch_seconds"] = (f"fitted so that iteration(4) = {it:.4f} s ({it_src}); the single-process "
                                         f"measurement was {meas['microbatch_seconds']} s")
    t_it = job.iteration_seconds(job.replicas)

    def pick(key: str) -> float:
        v, s_ = b.get(key, (meas[key], src[key]))
        sources[key] = s_
        return v

    startup = pick("startup_seconds")
    save, load = pick("checkpoint_save_seconds"), pick("checkpoint_load_seconds")
    async_stall = pick("checkpoint_async_stall_seconds")

    def from_kill(tag: str, key: str, default: float, default_src: str) -> float:
        """A baseline's restart cost: the bench's kill-to-next-commit minus the committing iteration
        and the load. The next commit after a restart is the checkpoint's next step, replayed
        first: the lost work is redone after it (kill_to_progress_s), so none is inside it."""
        if key in b:
            sources[key] = b[key][1]
            return b[key][0]
        if f"{tag}_kill_to_commit" in b:
            k, ks = b[f"{tag}_kill_to_commit"]
            sources[key] = f"derived: kill-to-next-commit minus the committing iteration and the load; {ks}"
            return max(0.0, k - t_it - load)
        sources[key] = default_src
        return default

    restart = from_kill("ckpt", "restart_seconds", meas["restart_seconds"], src["restart_seconds"])
    elastic = from_kill("elastic", "elastic_restart_seconds", meas["elastic_restart_seconds"],
                        src["elastic_restart_seconds"])
    ft_total, ft_src = b.get("torchft_recovery_seconds", (meas["torchft_seconds"], src["torchft_seconds"]))
    # torchft's kill-to-commit includes redoing the discarded step: take one iteration off.
    ft_detect = max(0.0, ft_total - t_it)
    sources["torchft_detect_seconds"] = "kill-to-next-commit minus one iteration; " + ft_src
    sources["torchft_quorum_seconds"] = "included in torchft_detect_seconds (the measurement covers both)"
    detect, rebuild = meas["recover_detect_seconds"], meas["recover_rebuild_seconds"]
    sources["recover_detect_seconds"] = src["recover_detect_seconds"]
    sources["recover_rebuild_seconds"] = src["recover_rebuild_seconds"]
    if "recover_detect_seconds" in b and "recover_rebuild_seconds" in b:  # measured apart (validation runs)
        (detect, sd), (rebuild, sr) = b["recover_detect_seconds"], b["recover_rebuild_seconds"]
        sources["recover_detect_seconds"], sources["recover_rebuild_seconds"] = sd, sr
    elif "recovery_seconds_p50" in b:
        # The bench measures detection + rebuild + redo together; subtract the model's own
        # mean redo and split what is left as the measured detect:rebuild.
        v, s_ = b["recovery_seconds_p50"]
        stall = max(0.0, v - _redo_mean(job))
        frac = detect / (detect + rebuild)
        detect, rebuild = stall * frac, stall * (1 - frac)
        note = f"{s_}, minus the model's mean redo, split as the measured detect:rebuild"
        sources["recover_detect_seconds"] = sources["recover_rebuild_seconds"] = note
    costs = Costs(
        startup_seconds=startup, recover_detect_seconds=detect, recover_rebuild_seconds=rebuild,
        hang_detect_seconds=3.0, restart_seconds=restart, checkpoint_save_seconds=save,
        checkpoint_load_seconds=load, checkpoint_async_stall_seconds=async_stall, elastic_restart_seconds=elastic, torchft_detect_seconds=ft_detect,
        torchft_quorum_seconds=0.0, join_seconds=startup,
    )
    sources["hang_detect_seconds"] = "recover train's default --heartbeat-timeout (3 s); a run's own config.json wins"
    sources["join_seconds"] = "a new worker's launch, taken equal to the measured startup"
    sources["recover_commit_seconds"] = "0: the coordinator's work is inside the measured iteration time"
    return Calibration("local", job, costs, sources)


# ---- cluster scale -----------------------------------------------------------------------
RESTART_ANCHOR_LARGE = (100_000, 600.0)  # FT-HSDP: a synchronous restart stalls ~10 minutes at 100k GPUs
"""Published (FT-HSDP), not measured here: the large anchor of the restart power law."""

@dataclass(frozen=True)
class RestartLaw:
    """restart(n) = small_seconds * (n / small_gpus) ** exponent, through a measured small anchor
    and FT-HSDP's published large one."""

    small_gpus: int  # GPUs (processes) of the measured restart
    small_seconds: float  # the measured restart there
    source: str  # where small_seconds comes from

    @property
    def exponent(self) -> float:
        n1, s1 = RESTART_ANCHOR_LARGE
        return math.log(s1 / self.small_seconds) / math.log(n1 / self.small_gpus)

    def __call__(self, n_gpus: int) -> float:
        return self.small_seconds * (n_gpus / self.small_gpus) ** self.exponent


def restart_law(bench: str | Path | None = None) -> RestartLaw:
    """The power law anchored on the restart the committed bench measured (results/bench/
    recovery_ckpt-restart.json, via local_calibration's derivation); without a bench file, the
    restart measured.py computes from the committed ckpt-restart runs."""
    local = local_calibration(bench)
    return RestartLaw(local.job.n_gpus, local.costs.restart_seconds, local.sources["restart_seconds"])


def restart_seconds(n_gpus: int, bench: str | Path | None = None) -> float:
    """A whole-job restart at n GPUs: the power law through the restart measured here (`restart_law`)
    and FT-HSDP's ~600 s at 100k GPUs. Assumed shape: restarts grow with scale (rendezvous,
    communicator set-up, loading) but sub-linearly; the exponent is whatever the two anchors give."""
    return restart_law(bench)(n_gpus)


COORDINATOR_BENCH = "coordinator_service.json"
COORDINATOR_SHARE = 0.01  # the share of an iteration the single coordinator may take


@dataclass(frozen=True)
class CoordinatorLaw:
    """commit(R) = fixed_seconds + per_replica_seconds * R: the coordinator's work per commit."""

    fixed_seconds: float  # the fit's intercept (clamped at 0: then fitted through the origin)
    per_replica_seconds: float  # the fit's slope
    source: str  # the results file and the rows fitted

    def __call__(self, replicas: int) -> float:
        return self.fixed_seconds + self.per_replica_seconds * replicas

    def largest_replicas(self, iteration_seconds: float, share: float = COORDINATOR_SHARE) -> int:
        """The largest R whose commit costs at most `share` of an iteration of this length."""
        return max(0, int((share * iteration_seconds - self.fixed_seconds) / self.per_replica_seconds))


def coordinator_law(bench: str | Path | None = None) -> CoordinatorLaw | None:
    """The fit to `recover bench coordinator --service`'s step latency (median per N); None without the file."""
    p = Path(bench) if bench is not None else DEFAULT_BENCH_DIR
    f = p / COORDINATOR_BENCH if p.is_dir() else None
    if f is None or not f.is_file():
        return None
    d = json.loads(f.read_text())
    pts = [(float(r["replicas"]), float(r["step_latency_s"])) for r in d["rows"]]
    if len(pts) < 2 or any(y <= 0 for _, y in pts):
        raise ValueError(f"{f}: need step_latency_s > 0 at two replica counts or more")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    if a < 0 or b <= 0:  # no fixed cost to speak of: through the origin
        a, b = 0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    rows = ", ".join(f"R={int(x)}: {y * 1e3:.1f} ms" for x, y in pts)
    return CoordinatorLaw(a, b, f"`{d.get('command') or 'recover bench coordinator --service'}` ({f}), step_latency_s "
                                f"median per N ({rows}), fitted {a * 1e3:.2f} ms + {b * 1e6:.1f} us x R")


CHECKPOINT_OPS = {"save_s": "dcp.save", "async_stall_s": "dcp.async_save's stall (until it returns)",
                  "async_total_s": "dcp.async_save until its future completes", "load_s": "dcp.load"}


def checkpoint_throughput(bench: str | Path | None = None) -> dict[str, tuple[float, str]] | None:
    """Bytes per second of each DCP operation from results/bench/checkpoint_dcp.json (`recover bench
    checkpoint`), op -> (bytes/s, source); None when the file is absent."""
    p = Path(bench) if bench is not None else DEFAULT_BENCH_DIR
    f = p / "checkpoint_dcp.json" if p.is_dir() else None
    if f is None or not f.is_file():
        return None
    d = json.loads(f.read_text())
    out = {}
    for op, what in CHECKPOINT_OPS.items():
        v = (d.get(op) or {}).get("bytes_per_s")
        if not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{f}: {op}.bytes_per_s must be a number > 0, got {v!r}")
        out[op] = (float(v), f"{what} at {v / 1e6:.0f} MB/s, `{d.get('command', 'recover bench checkpoint')}` ({f})")
    return out


def cluster_costs(n_gpus: int, gpus_per_replica: int, bench: str | Path | None = None,
                  tuned: bool = True, state_bytes: float | None = None) -> tuple[Costs, dict[str, str]]:
    """Costs at cluster scale with their sources; everything restart-like scales with the restart law.
    Every small-scale value comes from `local_calibration(bench)`, i.e. from the committed results/bench
    measurements and the committed real runs (measured.py). `tuned`: the baselines set as a competent
    user would (torchft's heartbeat timeout and elastic's last-call as short as the local baselines use,
    1 s); otherwise their upstream defaults (5 s and 30 s), charged by the difference. `state_bytes`: the checkpointed state of one model copy (weights + optimizer); with
    it and results/bench/checkpoint_dcp.json the blocking save, the async save's stall and the load are state_bytes / gpus_per_replica (what each GPU writes or reads) over
    the throughput measured here, assumed to be what each GPU gets from its storage."""
    local = local_calibration(bench)
    lc, ls = local.costs, local.sources
    law = restart_law(bench)
    scale = law(n_gpus) / law.small_seconds
    law_src = (f"restart_seconds(n) = {law.small_seconds:.3f} s * (n/{law.small_gpus})^{law.exponent:.3f} through the "
               f"restart measured here ({law.source}) and FT-HSDP's ~600 s at 100k GPUs (assumed shape)")
    # Untuned: the upstream defaults, charged as the policies charge their variants: the longer
    # last-call and heartbeat timeout add their difference from the settings measured here.
    last_call = float(BASELINE_LAST_CALL_S if tuned else UPSTREAM_LAST_CALL_S)
    ft_extra = 0.0 if tuned else (UPSTREAM_HEARTBEAT_TIMEOUT_MS - BASELINE_HEARTBEAT_TIMEOUT_MS) / 1000.0
    ft_detect = lc.torchft_detect_seconds + ft_extra
    costs = Costs(
        startup_seconds=0.0,
        recover_detect_seconds=lc.recover_detect_seconds * scale,
        recover_rebuild_seconds=lc.recover_rebuild_seconds * scale,
        hang_detect_seconds=60.0,
        restart_seconds=law(n_gpus),
        checkpoint_save_seconds=10.0,
        checkpoint_load_seconds=20.0,
        elastic_restart_seconds=law(n_gpus) + last_call,
        torchft_detect_seconds=ft_detect,
        torchft_quorum_seconds=lc.recover_rebuild_seconds * scale,
        join_seconds=law(gpus_per_replica),
    )
    coord = coordinator_law(bench)
    if coord is not None:
        costs = replace(costs, recover_commit_seconds=coord(n_gpus // gpus_per_replica))
    ck_src: dict[str, str] = {}
    tput = checkpoint_throughput(bench) if state_bytes else None
    if tput:
        per_gpu = state_bytes / gpus_per_replica
        costs = replace(costs, checkpoint_save_seconds=per_gpu / tput["save_s"][0],
                        checkpoint_async_stall_seconds=per_gpu / tput["async_stall_s"][0],
                        checkpoint_load_seconds=per_gpu / tput["load_s"][0])
        head = f"{per_gpu / 1e9:.2f} GB per GPU (state / {gpus_per_replica} GPUs per replica) over "
        ck_src = {"checkpoint_save_seconds": head + tput["save_s"][1] + " (a blocking save: ckpt-restart's default)",
                  "checkpoint_async_stall_seconds": head + tput["async_stall_s"][1] + " (ckpt-restart-async, "
                                                    "ckpt_async: dcp.async_save)",
                  "checkpoint_load_seconds": head + tput["load_s"][1]}
    sources = {
        "startup_seconds": "0: every system pays the same first launch, so it is left out at cluster scale",
        "recover_detect_seconds": f"the local value ({lc.recover_detect_seconds:.4f} s: "
                                  f"{ls['recover_detect_seconds']}) scaled like a restart: assumed, no cluster "
                                  "measurement",
        "recover_rebuild_seconds": f"the local value ({lc.recover_rebuild_seconds:.4f} s: "
                                   f"{ls['recover_rebuild_seconds']}) scaled like a restart (communicator set-up "
                                   "grows with ranks): assumed",
        "hang_detect_seconds": "assumed: a collective deadline of one minute",
        "restart_seconds": law_src,
        "checkpoint_save_seconds": "assumed: a blocking sharded save (not stated by the paper); see the sensitivity sweep",
        "checkpoint_load_seconds": "assumed: twice the save (every rank reads after a restart)",
        "elastic_restart_seconds": f"restart_seconds + a rendezvous last-call of {last_call:g} s ("
                                   + ("tuned as the local baseline sets it" if tuned
                                      else "TorchElastic's default") + ")",
        "torchft_detect_seconds": f"measured here with a 100 ms heartbeat: {ls['torchft_detect_seconds']}"
                                  + ("" if tuned else f"; plus {ft_extra:g} s for torchft's default heartbeat timeout "
                                     f"({UPSTREAM_HEARTBEAT_TIMEOUT_MS} ms, not {BASELINE_HEARTBEAT_TIMEOUT_MS})")
                                  + "; assumed not to grow with scale",
        "torchft_quorum_seconds": "as recover_rebuild_seconds (a process-group reconfiguration): assumed",
        "join_seconds": "a replica-sized launch, restart_seconds(gpus_per_replica): assumed",
        "checkpoint_async_stall_seconds": "None: a blocking save",
        "recover_commit_seconds": (f"the coordinator at R = {n_gpus // gpus_per_replica} replicas: {coord.source}"
                                   if coord is not None else f"0: no {COORDINATOR_BENCH} in the bench results"),
    }
    sources.update(ck_src)
    return costs, sources
