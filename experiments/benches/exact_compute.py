"""What `--exact` costs in the compute, in one process: fp32 against deterministic kernels alone
against exact mode (deterministic kernels + int64 fixed-point accumulation).

Contract:
- `python -m recover.experiments.benches.exact_compute --models tiny small --out results/bench/exact_compute.json`
  builds the real workload (`core.training.workload.Workload`, the model, data, AdamW recipe and
  accumulator every system trains) once per mode and times whole iterations: fold M
  microbatches (forward + backward, and in exact mode the conversion of each gradient to
  fixed point) and `apply` them (exact: convert the int64 sum back; divide, clip, AdamW). No
  communication (the all-reduce's bytes are given instead: int64 is twice fp32).
- The modes are interleaved, `--repeats` rounds of `--iters` iterations, after one untimed
  warm-up iteration each, so all see the same machine load; torch's deterministic-algorithms
  switch is process-wide, so it is set before each mode's iterations. Figures: the median
  iteration per mode and the ratios to fp32, from the same run. Nothing is asserted on.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from recover.core.config.train_config import TrainConfig
from recover.core.components.data import iteration_ids
from recover.core.training.workload import Workload

from .iteration import allreduce_bytes

MODES = ("fp32", "deterministic", "exact")


def _iteration(work: Workload, step: int, microbatches: int) -> float:
    start = time.perf_counter()
    for mb in iteration_ids(step, microbatches):
        work.fold(mb)
    work.apply(work.pack(), microbatches, step)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--microbatches", type=int, default=4, help="M per iteration (default: 4)")
    p.add_argument("--iters", type=int, default=3, help="iterations per mode per round (default: 3)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default: 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, as a worker)")
    p.add_argument("--out", default="results/bench/exact_compute.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for model in a.models:
        works = {}
        for mode in MODES:
            torch.use_deterministic_algorithms(mode != "fp32")
            cfg = TrainConfig(model=model, exact=mode == "exact", steps=10_000, microbatches=a.microbatches,
                              replicas=1)
            works[mode] = Workload(cfg, "cpu")
            _iteration(works[mode], 0, a.microbatches)  # first calls, allocations: not timed
        times: dict[str, list[float]] = {m: [] for m in MODES}
        step = 1
        for _ in range(a.repeats):
            for mode, work in works.items():
                torch.use_deterministic_algorithms(mode != "fp32")
                for _ in range(a.iters):
                    times[mode].append(_iteration(work, step, a.microbatches))
                    step += 1
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append({"model": model, "params": works["fp32"].model.num_params(), "iteration_s": med,
                     "over_fp32": {m: med[m] / med["fp32"] for m in MODES},
                     "allreduce_bytes": {"fp32": allreduce_bytes(model, "fp32"),
                                         "exact": allreduce_bytes(model, "exact")},
                     "runs_s": times})
        print(f"{model:6s} fp32 {1000 * med['fp32']:.1f} ms, deterministic x{med['deterministic'] / med['fp32']:.3f}, "
              f"exact x{med['exact'] / med['fp32']:.3f}", flush=True)
    result = {"bench": "exact_compute", "command": " ".join(sys.argv), "machine": platform.platform(),
              "torch": torch.__version__, "threads": a.threads, "microbatches": a.microbatches,
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
