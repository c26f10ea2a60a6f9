"""The weights-digest benchmark (`recover bench digest`): what catching silent data corruption costs.

Contract:
- For each model it builds the real workload (`core.training.workload.Workload`) and, in
  this process, times whole iterations (fold `--microbatches` microbatches, then
  the AdamW step) and, interleaved with them, the digest a replica puts in its
  vote (`GradAccumulator.weights_fingerprint`: integer sums of every weight's
  bits, on its device) beside the plain one (`weights_digest`: sha256 of every
  byte, on the host), `--repeats` rounds of `--iters` each after an untimed
  warm-up. Same process, same load: the figures are the ratios of the medians,
  digest / iteration, taken in one run.
- From that ratio it derives the smallest `--digest-every` K whose cost stays
  under 2% of an iteration (1 when a digest every step already does).
- Writes OUT/digest.json and prints a table. Nothing here is asserted on.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from recover.core.config.train_config import TrainConfig
from recover.core.training.workload import Workload

from .dtype import time_iteration

BUDGET = 0.02  # the share of an iteration a digest may cost


def _timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def bench_digest(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models:
        cfg = TrainConfig(model=model, batch_size=args.batch_size, steps=10_000, corpus_bytes=args.corpus_bytes,
                          microbatches=args.microbatches, replicas=1)
        work = Workload(cfg, "cpu")
        time_iteration(work, 0, args.microbatches)  # first calls, allocations: not timed
        digests = {"fingerprint": work.acc.weights_fingerprint, "sha256": work.acc.weights_digest}
        for f in digests.values():
            f()
        times: dict[str, list[float]] = {"iteration": [], **{k: [] for k in digests}}
        step = 1
        for _ in range(args.repeats):
            for _ in range(args.iters):
                times["iteration"].append(time_iteration(work, step, args.microbatches))
                for k, f in digests.items():
                    times[k].append(_timed(f))
                step += 1
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["fingerprint"] / med["iteration"]
        rows.append({
            "model": model, "params": work.model.num_params(), "iteration_seconds": med["iteration"],
            "fingerprint_seconds": med["fingerprint"], "sha256_seconds": med["sha256"],
            "fingerprint_over_iteration": ratio, "sha256_over_iteration": med["sha256"] / med["iteration"],
            # the most frequent digest (what --digest-every sets) that stays within the budget
            "every_k_under_2pct": max(1, math.ceil(ratio / BUDGET)), "samples": times,
        })
        del work
    result = {
        "what": "median seconds of one iteration (fold all microbatches + AdamW step) and of one weights digest: "
                "the fingerprint a vote carries (on-device integer sums) and the plain sha256 of every byte; "
                "same process, interleaved",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": args.threads},
        "batch_size": args.batch_size, "microbatches": args.microbatches, "iters": args.iters,
        "repeats": args.repeats, "budget": BUDGET, "models": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "digest.json").write_text(json.dumps(result, indent=2))
    print(f"{'model':<10} {'params':>11} {'iter s':>9} {'fprint s':>9} {'ratio':>7} {'sha256 s':>9} {'ratio':>7} "
          f"{'K<2%':>5}")
    for r in rows:
        print(f"{r['model']:<10} {r['params']:>11,} {r['iteration_seconds']:>9.4f} {r['fingerprint_seconds']:>9.5f} "
              f"{r['fingerprint_over_iteration']:>7.2%} {r['sha256_seconds']:>9.5f} {r['sha256_over_iteration']:>7.2%} "
              f"{r['every_k_under_2pct']:>5}")
    print(f"wrote {out / 'digest.json'}")
    return 0
