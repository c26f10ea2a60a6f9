"""The local measurements the calibration starts from, computed by code from committed results.

Contract: `local_measured(real, bench)` returns {key: (value, source)} for the keys of
MEASURED_KEYS, every value computed here from committed files and none typed in; a key
whose files are missing raises, naming what is missing (no silent fallback to a number):
- iteration_seconds, startup_seconds: the failure-free runs of 4 replicas, M = 8, under
  `real` (results/sim/real/*/plain*): the median over runs of each run's median step time
  and of its step 0's wall time (`realruns.reference_timing`);
- microbatch_seconds and allreduce2_seconds: the model's iteration formula solved for the
  microbatch time and the ring's latency from failure-free runs of 2 and 4 replicas of one
  folder (measured together; `fit_microbatch_and_latency`);
- checkpoint_save_seconds, checkpoint_async_stall_seconds, checkpoint_load_seconds: the tiny
  model's checkpointed state (TINY_STATE_BYTES) over the DCP save, async-save stall and load
  throughput of results/bench/checkpoint_dcp.json
  (`recover bench checkpoint`);
- recover_detect_seconds, recover_rebuild_seconds: medians over the recover runs' recoveries
  (`realruns.recovery_samples`: fault fired -> detected, detected -> next group formed);
- restart_seconds, elastic_restart_seconds: medians over the ckpt-restart and elastic runs'
  restarts (`realruns.restart_samples`, with the folder's failure-free step time and the load
  above); torchft_seconds: the median over torchft runs' loss -> next commit.
Runs are found by their config.json's train.system and shape, in any folder under `real`.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .realruns import (RealRun, _is_reference, _train, find_runs, load_run, recovery_samples, reference_timing,
                       restart_samples, torchft_samples)

REPO = Path(__file__).resolve().parents[2]
REAL_DIR = REPO / "results" / "sim" / "real"
"""The committed real runs of this machine (the validation batches)."""
BENCH_DIR = REPO / "results" / "bench"



def gpt_parameters(shape: dict) -> int:
    """Trainable parameters of the transformer of `shape` (a config.json "model" section: vocab_size,
    block_size, n_layer, n_embd, bias): token and position embeddings, per block 12 d^2 weights and two
    layer norms, a final layer norm; the output head shares the token embedding. A property of the
    model, computed without torch (the simulator stays free of it)."""
    d, layers = int(shape["n_embd"]), int(shape["n_layer"])
    bias = bool(shape.get("bias", False))
    # per block: attention 4 d^2 and MLP 8 d^2, two layer norms; biases: qkv 3d, proj d, fc 4d, proj d, norms 2d
    per_block = 12 * d * d + 2 * d + (11 * d if bias else 0)
    final_norm = d + (d if bias else 0)
    return int(shape["vocab_size"]) * d + int(shape["block_size"]) * d + layers * per_block + final_norm


TINY_PARAMETERS = gpt_parameters({"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_embd": 64})
"""The tiny model's trainable parameters (core/config/shapes.py's `tiny`: 119,104; a property of the model, not a measurement)."""
STATE_BYTES_PER_PARAMETER = 12
"""Checkpointed state per parameter: fp32 weights and AdamW's two fp32 moments (bf16 copies are derived, not saved)."""
TINY_STATE_BYTES = TINY_PARAMETERS * STATE_BYTES_PER_PARAMETER

TINY_GRAD_BYTES = (TINY_PARAMETERS + 1) * 4
"""The tiny model's gradient in fp32, plus the loss slot the accumulator carries."""
LOOPBACK_BANDWIDTH = 1e9  # assumed; on loopback the latency term dominates, so its value hardly matters
LOCAL_CPU_SLOTS = 2
"""This machine's CPU cores, shared by the replicas' processes (a property of the machine)."""


def _share(r: int) -> float:
    return r / LOCAL_CPU_SLOTS if r > LOCAL_CPU_SLOTS else 1.0


def ring_allreduce(r: int, latency: float) -> float:
    """The model's ring all-reduce of the tiny gradient over r replicas on loopback (model.py's formula)."""
    return 0.0 if r <= 1 else 2 * (r - 1) / r * TINY_GRAD_BYTES / LOOPBACK_BANDWIDTH + 2 * (r - 1) * latency


def fit_microbatch_and_latency(step_seconds: dict[int, float], microbatches: int) -> tuple[float, float]:
    """(microbatch seconds, link latency) solving iteration(R) = ceil(M/R) x share(R) x t_mb + allreduce(R)
    for two replica counts R (the keys of step_seconds); both clamped at 0."""
    (ra, ta), (rb, tb) = sorted(step_seconds.items())
    ca, cb = (-(-microbatches // r) * _share(r) for r in (ra, rb))
    ya, yb = ta - ring_allreduce(ra, 0.0), tb - ring_allreduce(rb, 0.0)
    da, db = 2 * (ra - 1), 2 * (rb - 1)
    det = ca * db - cb * da
    if det == 0:
        raise ValueError(f"replica counts {ra} and {rb} do not separate compute from the all-reduce")
    tmb, lat = (ya * db - yb * da) / det, (ca * yb - cb * ya) / det
    return max(0.0, tmb), max(0.0, lat)


MEASURED_KEYS = ("iteration_seconds", "microbatch_seconds", "allreduce2_seconds", "startup_seconds",
                 "checkpoint_save_seconds", "checkpoint_load_seconds", "checkpoint_async_stall_seconds",
                 "recover_detect_seconds",
                 "recover_rebuild_seconds", "restart_seconds", "torchft_seconds", "elastic_restart_seconds")

Measured = dict[str, tuple[float, str]]


def _runs(real: Path) -> list[RealRun]:
    if not real.is_dir():
        raise FileNotFoundError(f"{real}: the committed real runs the local calibration is computed from are missing")
    return [load_run(p) for p in find_runs(real)]


def _shape(run: RealRun) -> tuple[int, int]:
    tr = _train(run)
    return int(tr["replicas"]), int(tr["microbatches"])


def _median(xs: list[float], what: str) -> float:
    if not xs:
        raise ValueError(f"no committed measurement of {what}")
    return float(statistics.median(xs))


def _rel(paths) -> str:
    names = sorted({str(Path(p).relative_to(REPO)) if Path(p).is_relative_to(REPO) else str(p) for p in paths})
    return ", ".join(names)


def checkpoint_throughput_local(bench: Path) -> dict[str, tuple[float, str]]:
    """DCP save, async-save stall and load bytes/s from bench/checkpoint_dcp.json."""
    f = bench / "checkpoint_dcp.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: `recover bench checkpoint`'s results are missing")
    d = json.loads(f.read_text())
    out = {}
    for op in ("save_s", "async_stall_s", "load_s"):
        v = (d.get(op) or {}).get("bytes_per_s")
        if not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{f}: {op}.bytes_per_s must be a number > 0, got {v!r}")
        out[op] = (float(v), f"`{d.get('command', 'recover bench checkpoint')}` ({_rel([f])}): {op} at "
                             f"{v / 1e6:.0f} MB/s")
    return out


def local_measured(real: str | Path | None = None, bench: str | Path | None = None) -> Measured:
    """Every local measurement, computed from the committed runs under `real` (default results/sim/real)
    and the checkpoint bench under `bench` (default results/bench; the committed one when that folder
    has no checkpoint_dcp.json); see the module contract."""
    real = Path(real) if real is not None else REAL_DIR
    bench = Path(bench) if bench is not None else BENCH_DIR
    if not (bench / "checkpoint_dcp.json").is_file():  # a bench folder without it: the committed one
        bench = BENCH_DIR
    runs = _runs(real)
    refs = [r for r in runs if _is_reference(r)]
    out: Measured = {}

    # Timing of the validation shape (4 replicas, M = 8), and each folder's step time for the restarts.
    main = [reference_timing(r) for r in refs if _shape(r) == (4, 8)]
    main = [t for t in main if t]
    paths = [r.path for r in refs if _shape(r) == (4, 8)]
    for key, what in (("iteration_seconds", "median step time"), ("startup_seconds", "step 0's wall time")):
        out[key] = (_median([t[key][0] for t in main], key),
                    f"computed: median over the failure-free 4-replica M=8 runs of each run's {what} ({_rel(paths)})")
    folder_step = {r.path.parent: reference_timing(r)["iteration_seconds"][0]
                   for r in refs if _shape(r) == (4, 8) and reference_timing(r)}

    # One microbatch and the all-reduce's latency, from failure-free runs of 2 and 4 replicas measured
    # together: the model's iteration(R) = ceil(M/R) x share(R) microbatches + ring all-reduce(R), two
    # equations in the two unknowns (on 2 cores both shapes compute 4 microbatch-times at M = 8, so
    # their difference is the all-reduce's growth).
    by_folder: dict[Path, dict[int, RealRun]] = {}
    for r in refs:
        by_folder.setdefault(r.path.parent, {})[_shape(r)[0]] = r
    pair = next(((rs[2], rs[4]) for f, rs in sorted(by_folder.items()) if 2 in rs and 4 in rs
                 and _shape(rs[2])[1] == _shape(rs[4])[1]), None)
    if pair is None:
        raise ValueError(f"{real}: no folder holds failure-free runs of 2 and 4 replicas with one M "
                         "(the microbatch time and the all-reduce's latency)")
    (ra, rb), m = pair, _shape(pair[0])[1]
    ta, tb = reference_timing(ra)["iteration_seconds"][0], reference_timing(rb)["iteration_seconds"][0]
    tmb, lat = fit_microbatch_and_latency({2: ta, 4: tb}, m)
    where = _rel([ra.path, rb.path])
    out["microbatch_seconds"] = (tmb, f"computed: fitted with the link latency to the failure-free 2- and 4-replica "
                                      f"runs' median step times {ta:.4f} s and {tb:.4f} s, M={m} ({where})")
    out["allreduce2_seconds"] = (ring_allreduce(2, lat), f"computed: the ring all-reduce over 2 replicas with the "
                                                         f"latency {lat * 1e3:.2f} ms fitted with the microbatch "
                                                         f"time ({where})")

    tput = checkpoint_throughput_local(bench)
    for key, op in (("checkpoint_save_seconds", "save_s"), ("checkpoint_async_stall_seconds", "async_stall_s"),
                    ("checkpoint_load_seconds", "load_s")):
        v, s = tput[op]
        out[key] = (TINY_STATE_BYTES / v, f"computed: the tiny model's state ({TINY_PARAMETERS:,} parameters x "
                                          f"{STATE_BYTES_PER_PARAMETER} bytes) over {s}")
    load = out["checkpoint_load_seconds"][0]

    def of(system: str) -> list[RealRun]:
        return [r for r in runs if _train(r).get("system") == system and (r.plan or {}).get("faults")]

    rec = of("recover")
    samples = [s for r in rec for s in recovery_samples(r)]
    out["recover_detect_seconds"] = (_median([d for d, _ in samples], "recover's detection"),
                                     f"computed: median of {len(samples)} recoveries, fault fired (faults.jsonl) to "
                                     f"detected_at (events.jsonl) ({_rel([r.path for r in rec])})")
    out["recover_rebuild_seconds"] = (_median([b for _, b in samples], "recover's rebuild"),
                                      f"computed: the same {len(samples)} recoveries, detected_at to formed_at")
    for key, system in (("restart_seconds", "ckpt-restart"), ("elastic_restart_seconds", "elastic")):
        rs = [r for r in of(system) if r.path.parent in folder_step]
        xs = [x for r in rs for x in restart_samples(r, folder_step[r.path.parent], load)]
        out[key] = (_median(xs, f"{system}'s restart"),
                    f"computed: median of {len(xs)} restarts of `recover train --system {system}`, events.jsonl "
                    f"restart_seconds (to the first commit after the restart) minus that committing step (its folder's "
                    f"failure-free step time) and the load ({_rel([r.path for r in rs])})")
    ft = of("torchft")
    xs = [x for r in ft for x in torchft_samples(r)]
    out["torchft_seconds"] = (_median(xs, "torchft's recovery"),
                              f"computed: median of {len(xs)} losses of `recover train --system torchft` (its 100 ms "
                              f"heartbeat, 1 s quorum join timeout), loss to next committed step "
                              f"({_rel([r.path for r in ft])})")
    return out
