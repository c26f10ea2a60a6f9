"""Precision of `--exact` against fp32 mode: the loss curves of two runs of the same workload.

Contract:
- `python -m recover.experiments.benches.exact_precision --steps N --model small --out FILE` runs
  `recover train --system plain --replicas 1` twice, fp32 then `--exact`, same seed and
  workload, under --work (one replica: the fp32 run has a single summation order, so what
  differs is exact mode's fixed point alone), or with `--runs FP32_DIR EXACT_DIR` reads two
  finished runs instead.
- Writes FILE: per step both losses and |exact - fp32| / |fp32|, and the largest relative
  difference with its step (the bar exact mode is held to: within 1e-4 over 200 steps of the small model).
  Nothing here is asserted on.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from recover.core.storage.results import read_metrics


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run / "metrics.jsonl")]


def _train(out: Path, model: str, steps: int, microbatches: int, exact: bool) -> None:
    argv = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "plain", "--model", model,
            "--replicas", "1", "--microbatches", str(microbatches), "--steps", str(steps), "--out", str(out),
            "--no-progress"] + (["--exact"] if exact else [])
    subprocess.run(argv, check=True, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--work", default="/tmp/recover-exact-precision")
    p.add_argument("--runs", nargs=2, metavar=("FP32_DIR", "EXACT_DIR"), help="read two finished runs instead")
    p.add_argument("--out", default="results/bench/exact_precision.json")
    a = p.parse_args(argv)
    if a.runs:
        fp32_dir, exact_dir = map(Path, a.runs)
    else:
        fp32_dir, exact_dir = Path(a.work) / "fp32", Path(a.work) / "exact"
        _train(fp32_dir, a.model, a.steps, a.microbatches, exact=False)
        _train(exact_dir, a.model, a.steps, a.microbatches, exact=True)
    fp32, exact = _losses(fp32_dir), _losses(exact_dir)
    if len(fp32) != len(exact) or not fp32:
        raise SystemExit(f"the runs have {len(fp32)} and {len(exact)} steps")
    rel = [abs(e - f) / abs(f) for f, e in zip(fp32, exact)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    cfg = json.loads((exact_dir / "config.json").read_text())["train"]
    result = {"bench": "exact_precision", "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "model": cfg["model"], "steps": len(fp32), "microbatches": cfg["microbatches"],
              "exact_range": cfg["exact_range"], "max_rel_diff": rel[worst], "at_step": worst,
              "final_loss": {"fp32": fp32[-1], "exact": exact[-1]},
              "steps_rows": [{"step": i, "fp32": f, "exact": e, "rel": r}
                             for i, (f, e, r) in enumerate(zip(fp32, exact, rel))]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{cfg['model']}, {len(fp32)} steps: max |exact - fp32| / |fp32| = {rel[worst]:.3g} at step {worst} "
          f"-> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
