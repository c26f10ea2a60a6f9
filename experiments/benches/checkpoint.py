"""The checkpoint benchmark (`recover bench checkpoint`): DCP save, async save and load throughput here.

Contract:
- One process, no process group: a state dict of `--mib` MiB of fp32 tensors (split
  into `--tensors` tensors, like a model's parameters and optimizer state) is saved
  with torch.distributed.checkpoint.save, saved with dcp.async_save (the baseline's
  save: the stall is the time until async_save returns, the snapshot; the total is
  until its future completes), and loaded with dcp.load, `--repeats` times each, into
  a fresh directory each time.
- Writes results/bench/checkpoint_dcp.json: bytes, per operation the seconds (p50,
  min, max, n) and bytes per second at the p50, the command and the time. The
  simulator (experiments/sim/calibration.py, `checkpoint_throughput`) scales these by
  the bytes each GPU of a scenario writes. Nothing here is asserted on: it is a
  measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _stats(xs: list[float], nbytes: int) -> dict:
    p50 = statistics.median(xs)
    return {"p50": p50, "min": min(xs), "max": max(xs), "n": len(xs), "bytes_per_s": nbytes / p50 if p50 > 0 else None}


def bench_checkpoint(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", category=UserWarning)  # dcp warns that no process group is set up
    n = args.mib * 1024 * 1024 // 4
    per = n // args.tensors
    state = {f"t{i}": torch.randn(per) for i in range(args.tensors)}
    nbytes = per * args.tensors * 4
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    save, stall, total, load = [], [], [], []
    try:
        for i in range(args.repeats):  # interleaved, so load drifts hit every operation alike
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=str(work / f"sync{i}"))
            save.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=str(work / f"async{i}"))
            stall.append(time.perf_counter() - t0)
            fut.result()
            total.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dcp.load(state, checkpoint_id=str(work / f"sync{i}"))
            load.append(time.perf_counter() - t0)
            shutil.rmtree(work / f"async{i}", ignore_errors=True)
            shutil.rmtree(work / f"sync{i}", ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    out = {"bytes": nbytes, "tensors": args.tensors, "repeats": args.repeats,
           "save_s": _stats(save, nbytes), "async_stall_s": _stats(stall, nbytes),
           "async_total_s": _stats(total, nbytes), "load_s": _stats(load, nbytes),
           "command": "recover bench checkpoint " + " ".join(sys.argv[3:]),
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "checkpoint_dcp.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for k in ("save_s", "async_stall_s", "async_total_s", "load_s"):
        print(f"  {k:<14} p50 {out[k]['p50']:.3f} s  {out[k]['bytes_per_s'] / 1e6:8.1f} MB/s")
    print(f"-> {path}")
    return 0
