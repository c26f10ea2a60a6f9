"""The checkpoint-stall benchmark (`recover bench checkpoint-stall`): what recover's async checkpoint costs a step.

Contract:
- One real `recover` run (`run_training`: a coordinator and --replicas workers) with
  `--checkpoint-every K`. The writer's stall is what `CheckpointSaver` measured for
  each save (DIR/checkpoints.jsonl `stall_seconds`: from the save's start to
  `dcp.async_save` returning, the staging copy). An iteration is the time between
  two consecutive commits in metrics.jsonl; steps 0 and 1 are left out (one-time
  costs of first calls). Iterations right after a save (step s, s a multiple of K:
  the writer saves after s-1's commit, before folding s) carry the stall; the others
  do not.
- Writes results/bench/checkpoint_stall.json: per model the stalls, the medians of
  both kinds of iteration, and the ratios `stall_per_iteration` (median stall /
  median iteration without a save) and `iteration_with_save_ratio` (median
  iteration with a save / without), all measured in the same run; the command and
  the time. Nothing is asserted: it is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from recover.core.config.train_config import TrainConfig
from recover.core.storage.results import read_jsonl, read_metrics

from ..run import run_training


def _one_model(model: str, args: argparse.Namespace, work: Path) -> dict:
    cfg = TrainConfig(system="recover", model=model, replicas=args.replicas, microbatches=args.microbatches,
                      steps=args.steps, checkpoint_every=args.checkpoint_every, out=str(work / model),
                      progress=False, threads=args.threads)
    cfg.validate()
    summary = run_training(cfg)
    if summary["status"] != "ok":
        raise RuntimeError(f"{model}: the benchmark run failed: {summary['reason']}")
    metrics = read_metrics(Path(cfg.out) / "metrics.jsonl")
    saves = [r for r in read_jsonl(Path(cfg.out) / "checkpoints.jsonl") if not r.get("failed")]
    wall = {m["step"]: m["wall_time"] for m in metrics}
    with_save, without = [], []
    for s in range(2, cfg.steps):
        (with_save if s % cfg.checkpoint_every == 0 else without).append(wall[s] - wall[s - 1])
    stalls = [r["stall_seconds"] for r in saves]
    it = statistics.median(without)
    return {
        "steps": cfg.steps, "checkpoint_every": cfg.checkpoint_every, "replicas": cfg.replicas,
        "microbatches": cfg.microbatches, "saves": len(saves),
        "stall_seconds": stalls, "write_seconds": [r["write_seconds"] for r in saves],
        "iteration_seconds_p50": it, "iteration_with_save_seconds_p50": statistics.median(with_save),
        "stall_per_iteration": statistics.median(stalls) / it,
        "iteration_with_save_ratio": statistics.median(with_save) / it,
    }


def bench_checkpoint_stall(args: argparse.Namespace) -> int:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_ckpt_stall_"))
    results = {m: _one_model(m, args, work) for m in args.models}
    out = {"models": results, "command": "recover bench checkpoint-stall " + " ".join(sys.argv[3:]),
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "checkpoint_stall.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for m, r in results.items():
        print(f"  {m:<8} stall p50 {statistics.median(r['stall_seconds']) * 1e3:7.1f} ms = "
              f"{r['stall_per_iteration']:.3f} of an iteration ({r['iteration_seconds_p50']:.3f} s); "
              f"iteration with a save / without: {r['iteration_with_save_ratio']:.2f}")
    print(f"-> {path}")
    return 0
