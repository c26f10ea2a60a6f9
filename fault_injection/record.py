"""The fault record, DIR/faults.jsonl: every fault that fired, written before it takes effect.

Contract:
- One JSON object per fired fault: `index` (its position in the plan), `kind`,
  `replica`, `rank`, `pid` (the process it hit), `step`, `phase`, `microbatch`
  (None for wall-clock faults fired from outside), `wall_time` (seconds since the
  run started, the clock metrics.jsonl's wall_time uses), `time` (the absolute
  time.time() it fired), `fired_by` ("worker" or "launcher"), and the
  parameters its kind accepts (fault_injection.kinds: a hang's `seconds`, a slow
  fault's `factor`), even when left at None.
- A record is appended with a single write() on an O_APPEND descriptor, then
  fsync'd, before the fault is made to happen: the process about to SIGKILL or
  freeze itself cannot lose it, and concurrent writers (every worker and the
  launcher append to the same file) never interleave within a line.
- `fired_indices(DIR)` is what makes a fault fire at most once per run: a
  restarted worker, or a restarted launcher, reads it and skips those faults.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .plan import Fault

FAULTS_FILE = "faults.jsonl"
PLAN_FILE = "fault_plan.json"


def fault_record(
    index: int, fault: Fault, pid: int, t0: float, step: int | None = None, phase: str | None = None,
    microbatch: int | None = None, fired_by: str = "worker",
) -> dict[str, Any]:
    """The faults.jsonl line for `fault` (plan index `index`) firing now in process `pid`."""
    now = time.time()
    rec: dict[str, Any] = {
        "index": index, "kind": fault.kind, "replica": fault.replica, "rank": fault.rank, "pid": pid,
        "step": step, "phase": phase, "microbatch": microbatch,
        "wall_time": now - t0, "time": now, "fired_by": fired_by,
    }
    for name in fault.spec.accepts:
        rec[name] = getattr(fault, name)
    return rec


def append_record(out_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one line to DIR/faults.jsonl durably (write, flush, fsync)."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(Path(out_dir) / FAULTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every whole record in DIR/faults.jsonl ([] if none fired)."""
    path = Path(out_dir) / FAULTS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a torn line cannot happen with O_APPEND, but never trust it
            continue
    return records


def fired_indices(out_dir: str | os.PathLike) -> set[int]:
    """Plan indices that already fired in this run."""
    return {int(r["index"]) for r in read_records(out_dir) if "index" in r}
