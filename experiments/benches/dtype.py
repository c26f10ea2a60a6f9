"""The precision benchmark (`recover bench dtype`): time per iteration, fp32 vs bf16 autocast.

Contract:
- For each model it builds the real workload (`core.training.workload.Workload`: the same
  model, data, AdamW recipe and accumulator every system trains) once per dtype
  and times whole iterations in this process: fold `--microbatches` microbatches
  (forward + backward) and commit them (`apply`: divide, clip, AdamW step). No
  communication: this isolates what autocast changes in the compute.
- The dtypes are interleaved, `--repeats` rounds of `--iters` iterations each,
  after one untimed warm-up iteration per workload, so both see the same machine
  load; the figure is the median iteration time per dtype and their ratio, taken
  in the same run (these machines are noisy: only same-run ratios count).
- Writes OUT/dtype.json and prints a table. Nothing here is asserted on.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from recover.core.config.train_config import TrainConfig
from recover.core.components.data import iteration_ids
from recover.core.training.workload import Workload


def time_iteration(work: Workload, step: int, microbatches: int) -> float:
    start = time.perf_counter()
    for mb in iteration_ids(step, microbatches):
        work.fold(mb)
    work.apply(work.pack(), microbatches, step)
    return time.perf_counter() - start


def bench_dtype(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models:
        works = {}
        for dtype in ("fp32", "bf16"):
            cfg = TrainConfig(model=model, dtype=dtype, batch_size=args.batch_size, steps=10_000,
                              corpus_bytes=args.corpus_bytes, microbatches=args.microbatches, replicas=1)
            works[dtype] = Workload(cfg, "cpu")
            time_iteration(works[dtype], 0, args.microbatches)  # first calls, allocations: not timed
        times: dict[str, list[float]] = {"fp32": [], "bf16": []}
        step = 1
        for _ in range(args.repeats):
            for dtype, work in works.items():
                for _ in range(args.iters):
                    times[dtype].append(time_iteration(work, step, args.microbatches))
                    step += 1
        fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
        cfg = works["fp32"].cfg
        rows.append({
            "model": model, "params": works["fp32"].model.num_params(),
            "tokens_per_iteration": args.microbatches * works["fp32"].tokens_per_microbatch,
            "fp32_seconds": fp32, "bf16_seconds": bf16, "bf16_over_fp32": bf16 / fp32,
            "samples": {k: v for k, v in times.items()}, "block_size": cfg.gpt_config().block_size,
        })
        del works
    result = {
        "what": "median seconds per iteration (fold all microbatches + AdamW step), fp32 vs bf16 autocast, "
                "same process, interleaved",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": args.threads, "cuda": torch.cuda.is_available()},
        "batch_size": args.batch_size, "microbatches": args.microbatches, "iters": args.iters,
        "repeats": args.repeats, "models": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dtype.json").write_text(json.dumps(result, indent=2))
    print(f"{'model':<10} {'params':>11} {'fp32 s/it':>10} {'bf16 s/it':>10} {'bf16/fp32':>10}")
    for r in rows:
        print(f"{r['model']:<10} {r['params']:>11,} {r['fp32_seconds']:>10.3f} {r['bf16_seconds']:>10.3f} "
              f"{r['bf16_over_fp32']:>10.2f}")
    print(f"wrote {out / 'dtype.json'}")
    return 0
