"""`make demo`: the main job, end to end on this machine.

Contract: runs the tiny model with 4 replicas and prints a summary a newcomer can
read (the loss curve, where the results landed); exits non-zero if the run failed.
"""
from __future__ import annotations

import sys

from recover.core.config import TrainConfig
from recover.core.results import read_jsonl

from .cli import run_training


def main() -> int:
    out = "runs/demo/plain"
    cfg = TrainConfig(system="plain", replicas=4, microbatches=8, steps=30, out=out)
    cfg.validate()
    print(f"training the tiny model: {cfg.replicas} replicas, M={cfg.microbatches}, {cfg.steps} steps ...")
    summary = run_training(cfg)
    metrics = read_jsonl(f"{out}/metrics.jsonl")
    print(f"\n{'step':>5} {'loss':>8}")
    for m in metrics[:: max(1, len(metrics) // 10)] + metrics[-1:]:
        print(f"{m['step']:>5} {m['loss']:>8.4f}")
    print(f"\n{summary['status']}: {summary['steps']} steps in {summary['wall_time']:.1f}s; results in {out}/")
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
