"""The coordinator-restart benchmark (`recover bench coordinator-restart`): seconds from a kill to the next commit.

Contract:
- Real `recover train --system recover` runs (tiny model by default), each with
  one planned fault at a step in the middle of the run, `--repeats` rounds,
  the scenarios interleaved so the machine's load falls on all of them alike:
    replica_crash      a replica SIGKILLed mid-iteration (the reference: an ordinary recovery)
    coordinator_crash  the coordinator SIGKILLed by a worker mid-iteration
    mid_commit         the coordinator SIGKILLs itself after one member heard the commit
    coordinator_hang   the coordinator SIGSTOPped; found by its silence (--coordinator-timeout)
- Each figure is read from what the run wrote: the fault's time in
  DIR/faults.jsonl (recorded before it took effect) to the wall time of the
  metrics.jsonl commit of the step it struck (for mid_commit, the step after). Also each run's "rebuilt" event and the
  restarted coordinator's start (from coordinator.log). A run that does not
  complete, or whose planned fault did not fire, is reported as failed, never
  measured.
- Written to OUT/coordinator_restart.json: per scenario the seconds of each run,
  their median, and the ratio of each median to replica_crash's median measured in
  the same invocation. Printed too. Nothing here is asserted on.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recover.core.storage.results import read_jsonl, read_metrics

SCENARIOS = {
    "replica_crash": {"kind": "crash", "replica": 1, "phase": "backward"},
    "coordinator_crash": {"kind": "coordinator_crash", "replica": 1, "phase": "backward"},
    "mid_commit": {"kind": "coordinator_crash", "replica": 0, "phase": "commit_sent"},
    "coordinator_hang": {"kind": "coordinator_hang", "replica": 1, "phase": "backward"},
}


def _one(work: Path, name: str, round_: int, args: argparse.Namespace) -> dict:
    out = work / f"{name}_{round_}"
    plan = work / f"{name}_{round_}.json"
    step = args.steps // 2
    plan.write_text(json.dumps({"faults": [{**SCENARIOS[name], "step": step}]}))
    cmd = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "recover", "--model", args.model,
           "--replicas", str(args.replicas), "--microbatches", str(args.microbatches), "--steps", str(args.steps),
           "--coordinator-timeout", str(args.coordinator_timeout), "--no-progress", "--faults", str(plan),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    faults = read_jsonl(out / "faults.jsonl")
    metrics = read_metrics(out / "metrics.jsonl")
    if proc.returncode != 0 or len(faults) != 1 or len(metrics) != args.steps:
        return {"ok": False, "why": (proc.stdout + proc.stderr)[-400:]}
    fired = faults[0]["wall_time"]
    # the commit of the step it struck (a step's record is written after its commit messages
    # went out, so the previous step's line can land after a fault early in the next step)
    first = faults[0]["step"] + (1 if faults[0]["phase"] == "commit_sent" else 0)  # its step had committed
    after = [m["wall_time"] for m in metrics if m["step"] >= first and m["wall_time"] > fired]
    rebuilt = [e for e in read_jsonl(out / "events.jsonl") if e.get("kind") == "rebuilt"]
    return {"ok": True, "seconds": min(after) - fired, "fired_at_step": faults[0]["step"],
            "rebuilt_at": rebuilt[0]["at"] - fired if rebuilt else None}


def bench_coordinator_restart(args: argparse.Namespace) -> int:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_coord_restart_"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    t0 = time.time()
    for i in range(args.repeats):
        for name in SCENARIOS:
            r = _one(work, name, i, args)
            runs[name].append(r)
            shown = f"{r['seconds']:.2f}s" if r["ok"] else f"FAILED: {r['why']}"
            print(f"[{time.time() - t0:6.0f}s] round {i + 1}/{args.repeats} {name}: kill -> next commit {shown}",
                  file=sys.stderr, flush=True)
    medians = {name: statistics.median([r["seconds"] for r in rs if r["ok"]]) if any(r["ok"] for r in rs) else None
               for name, rs in runs.items()}
    ref = medians["replica_crash"]
    result = {
        "what": "seconds from a fault (its faults.jsonl time) to the next commit in metrics.jsonl",
        "command": "recover bench coordinator-restart " + " ".join(sys.argv[3:]),
        "model": args.model, "replicas": args.replicas, "microbatches": args.microbatches, "steps": args.steps,
        "coordinator_timeout": args.coordinator_timeout, "repeats": args.repeats,
        "machine": platform.platform(), "runs": runs, "median_seconds": medians,
        "ratio_to_replica_crash": {n: (m / ref if m is not None and ref else None) for n, m in medians.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coordinator_restart.json").write_text(json.dumps(result, indent=1))
    for name, m in medians.items():
        ratio = result["ratio_to_replica_crash"][name]
        print(f"{name:18s} median {'n/a' if m is None else f'{m:.2f}s'}"
              + ("" if ratio is None else f"  ({ratio:.2f}x a replica crash)"))
    print(f"-> {out / 'coordinator_restart.json'}")
    return 0 if all(r["ok"] for rs in runs.values() for r in rs) else 1
