"""Bookkeeping that lets a restarted job tell what a restart cost, and keep metrics once per step.

Contract (DIR = the run's --out; everything baseline-internal lives in DIR/baseline/):
- The work log DIR/baseline/worklog/replica<r>.txt has one line "<generation>
  <step> <microbatch id>" per microbatch *begun*, flushed before its forward pass,
  so the microbatches lost to a fault (committed, done, or still in flight) can be
  counted after the process that did them is dead, and the furthest step any
  incarnation began is known (`furthest_step_begun`).
- `append_step_once(path, record)` appends a JSON line keyed by its "step" only if
  the file's last whole record has a lower step, under an exclusive lock on the file:
  any replica that holds a committed step's record may write it, it lands once and in
  step order, and a writer that wakes up late (frozen, then resumed) finds it written.
- Detections DIR/baseline/detections.jsonl: a surviving worker appends when and how
  it saw its group fail (an exception, or its agent stopping it), so the next
  incarnation can date the fault it recovered from.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from recover.core.storage.results import read_jsonl


def baseline_dir(out: str | os.PathLike) -> Path:
    return Path(out) / "baseline"


def fault_notice_path(out: str | os.PathLike, generation: int) -> Path:
    """Where the supervisor leaves what it knows of the fault that caused attempt `generation`."""
    return baseline_dir(out) / f"fault-{generation}.json"


def _last_step(f) -> int:
    """The step of the last whole record in the open file `f` (-1 if none)."""
    size = f.seek(0, os.SEEK_END)
    tail = 1 << 16
    while True:
        f.seek(max(0, size - tail))
        lines = f.read().split(b"\n")
        if size > tail:
            lines = lines[1:]  # the first may start mid-record
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):  # empty, torn by a killed writer
                continue
        if size <= tail:
            return -1
        tail *= 4


def append_step_once(path: str | os.PathLike, record: dict[str, Any]) -> bool:
    """Append `record` unless a record of its step or a later one is already there; True if written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies holding it
        try:
            if _last_step(f) >= record["step"]:
                return False
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a writer killed mid-line: end its torn line first
                    f.write(b"\n")
            f.write((json.dumps(record) + "\n").encode())
            f.flush()
            return True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class WorkLog:
    """One replica's append-only record of the microbatches it folded."""

    def __init__(self, out: str | os.PathLike, replica: int, generation: int):
        d = baseline_dir(out) / "worklog"
        d.mkdir(parents=True, exist_ok=True)
        self.generation = generation
        self._f = open(d / f"replica{replica}.txt", "a", buffering=1)

    def begin(self, step: int, mb_id: int) -> None:
        self._f.write(f"{self.generation} {step} {mb_id}\n")

    def close(self) -> None:
        self._f.close()


def _worklog_lines(out: str | os.PathLike):
    d = baseline_dir(out) / "worklog"
    if not d.is_dir():
        return
    for p in sorted(d.glob("replica*.txt")):
        for line in p.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a torn last line from a killed writer is skipped
                yield int(parts[0]), int(parts[1]), int(parts[2])


def microbatches_begun(out: str | os.PathLike, generation: int, from_step: int) -> int:
    """Microbatches any replica began in `generation` at steps >= from_step (the work a restart loses)."""
    return sum(1 for g, step, _ in _worklog_lines(out) if g == generation and step >= from_step)


def furthest_step_begun(out: str | os.PathLike, generation: int | None = None) -> int:
    """The highest step any replica began, of incarnation `generation` or of any so far (-1 if none)."""
    return max((step for g, step, _ in _worklog_lines(out) if generation is None or g == generation), default=-1)


def record_detection(out: str | os.PathLike, generation: int, replica: int, t0: float, how: str) -> None:
    """A survivor's note that it saw generation `generation` fail, and how."""
    d = baseline_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    rec = {"generation": generation, "replica": replica, "at": time.time() - t0, "how": how[:300]}
    with open(d / "detections.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def first_detection(out: str | os.PathLike, generation: int) -> dict[str, Any] | None:
    """The earliest detection recorded for `generation`, if any."""
    recs = [r for r in read_jsonl(baseline_dir(out) / "detections.jsonl") if r["generation"] == generation]
    return min(recs, key=lambda r: r["at"]) if recs else None
