"""The heal benchmark (`recover bench heal`): seconds from a replica's kill to its replacement's first commit.

Contract:
- Real `recover train --system recover` runs, `--repeats` of them, each with one planned
  `crash` (a SIGKILL) of replica 1's rank `--rank` at the backward of the middle step,
  `--replace-after` for the launcher to start a replacement, and `--min-replicas` equal
  to `--replicas`, so the run goes back to full strength (a replica of `--shard` ranks is
  healed rank to rank: core/worker/state_transfer.py).
- Each figure is read from what the run wrote, never from what it was told: the kill's
  time from DIR/faults.jsonl (recorded by the struck process before it took effect), the
  replacement's from its "join" record in DIR/events.jsonl (its start, its hello, its
  admission, its state's arrival and its first commit, on the run's clock). Full strength
  is that first commit. A run that does not complete, whose fault did not fire, or whose
  replacement never committed, is reported as failed, never measured.
- Written to OUT/heal_time.json: per run the seconds from the kill to the replacement's
  start, to its hello, to its admission, to its state's arrival and to its first commit,
  the transfer's bytes and seconds, and the medians. Printed too. Nothing here is
  asserted on.
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

PHASES = ("started_at", "hello_at", "admitted_at", "healed_at", "first_commit_at")  # the join record's clock


def _one(work: Path, round_: int, args: argparse.Namespace) -> dict:
    out = work / f"heal_{round_}"
    plan = work / f"heal_{round_}.json"
    plan.write_text(json.dumps({"faults": [{"kind": "crash", "replica": 1, "rank": args.rank,
                                            "step": args.steps // 2, "phase": "backward", "microbatch": 0}]}))
    cmd = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "recover", "--model", args.model,
           "--replicas", str(args.replicas), "--shard", str(args.shard), "--microbatches", str(args.microbatches),
           "--steps", str(args.steps), "--heartbeat-timeout", str(args.heartbeat_timeout),
           "--replace-after", str(args.replace_after), "--min-replicas", str(args.replicas), "--no-progress",
           "--faults", str(plan), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    faults = read_jsonl(out / "faults.jsonl")
    joins = [e for e in read_jsonl(out / "events.jsonl") if e.get("kind") == "join" and e.get("replica") == 1]
    if proc.returncode != 0 or len(faults) != 1 or len(read_metrics(out / "metrics.jsonl")) != args.steps \
            or len(joins) != 1:
        return {"ok": False, "why": (proc.stdout + proc.stderr)[-400:]}
    killed, join = faults[0]["wall_time"], joins[0]
    return {"ok": True, **{f"kill_to_{p.removesuffix('_at')}_s": join[p] - killed for p in PHASES},
            "transfer_bytes": join["bytes"], "transfer_s": join["transfer_seconds"],
            "first_commit_step": join["first_commit_step"], "killed_at_step": faults[0]["step"]}


def bench_heal(args: argparse.Namespace) -> int:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_heal_"))
    work.mkdir(parents=True, exist_ok=True)
    runs, t0 = [], time.time()
    for i in range(args.repeats):
        r = _one(work, i, args)
        runs.append(r)
        shown = f"{r['kill_to_first_commit_s']:.2f}s" if r["ok"] else f"FAILED: {r['why']}"
        print(f"[{time.time() - t0:6.0f}s] run {i + 1}/{args.repeats}: kill -> full strength {shown}",
              file=sys.stderr, flush=True)
    ok = [r for r in runs if r["ok"]]
    keys = [f"kill_to_{p.removesuffix('_at')}_s" for p in PHASES] + ["transfer_s"]
    medians = {k: statistics.median(r[k] for r in ok) for k in keys} if ok else {}
    result = {
        "what": "seconds from a replica's kill (faults.jsonl) to its replacement's first commit (events.jsonl join)",
        "command": "recover bench heal " + " ".join(sys.argv[3:]),
        "model": args.model, "replicas": args.replicas, "shard": args.shard, "rank": args.rank,
        "microbatches": args.microbatches, "steps": args.steps, "replace_after": args.replace_after,
        "heartbeat_timeout": args.heartbeat_timeout, "repeats": args.repeats, "machine": platform.platform(),
        "runs": runs, "median": medians,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heal_time.json").write_text(json.dumps(result, indent=1))
    for k, v in medians.items():
        print(f"{k:26s} median {v:.3f}s")
    print(f"-> {out / 'heal_time.json'}")
    return 0 if len(ok) == len(runs) else 1
