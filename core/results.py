"""The results contract every system writes, and experiment grids and figures read.

Contract (DIR = the run's --out):
- DIR/config.json: {"train": the full resolved TrainConfig, "model": the resolved
  model shape, plus each system's own settings}.
- DIR/metrics.jsonl: one JSON object per committed iteration, in step order, each
  step at most once, with at least: step (from 0), loss (the iteration's mean
  microbatch loss), tokens, microbatch_ids (sorted ids folded into that step's
  gradient), generation, members (replica ids that took part), wall_time (seconds
  since the run started), and lr (the learning rate that step used, as the
  replicas that committed it reported it). recover's coordinator also writes
  `ledgers`: {member: the id ranges that member's vote reported folding}, and
  derives microbatch_ids from their union; `reported_ids` recomputes that union
  for a reader, so a check of the ids rests on what the workers said, not on
  what the coordinator handed out; and `coordinator`, its own load at that commit
  (latency from the last vote, CPU seconds, lines handled: core/membership.py).
- DIR/summary.json: steps done, final loss, tokens, wall time, exit status.
- DIR/events.jsonl (systems that recover): one object per recovery or restart;
  recover's coordinator adds one per refused control message ("kind": "refused",
  with the peer and what was refused) and a last "run_end" line.
- DIR/final/replica<r>.json: {"replica", "step", "weights_checksum"} written by each
  replica that finished the run (`write_final`); summary.json then carries
  `weights_checksum` when all of them agree (and `final_checksums` always).
Lines are appended and flushed one at a time, so a crash loses at most the line
being written; readers skip a torn last line.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

from . import idranges

METRIC_FIELDS = ("step", "loss", "tokens", "microbatch_ids", "generation", "members", "wall_time", "lr")


class JsonlWriter:
    """Append-only JSON-lines file, one flushed line per record."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All whole records of a JSON-lines file ([] if it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn final line from a killed writer
            continue
    return out


def truncate_metrics(out: str | os.PathLike, start: int) -> list[dict[str, Any]]:
    """Keep only metrics.jsonl lines with step < start; return the dropped ones.

    They are redone from the checkpoint of step `start`. The kept lines are written
    to a new file renamed over the old, so a reader never sees a half-truncated file."""
    path = Path(out) / "metrics.jsonl"
    records = read_jsonl(path)
    keep = [r for r in records if r["step"] < start]
    dropped = [r for r in records if r["step"] >= start]
    if path.exists():  # rewritten even with nothing dropped: a torn last line goes too
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, path)
    return dropped


def metric_record(
    step: int, loss: float, tokens: int, ids: Iterable[int], generation: int, members: Iterable[int],
    t0: float, **extra: Any,
) -> dict[str, Any]:
    """One metrics.jsonl line; `t0` is the run's start on the time.time() clock."""
    return {
        "step": step, "loss": loss, "tokens": tokens, "microbatch_ids": sorted(ids),
        "generation": generation, "members": sorted(members), "wall_time": time.time() - t0, **extra,
    }


def reported_ids(record: dict[str, Any]) -> list[int]:
    """The sorted ids a committed step's members reported folding (its `ledgers`' union).

    ValueError if two members reported the same id (a double-counted microbatch)
    or the record carries no per-member ledgers (a system that does not report them)."""
    if "ledgers" not in record:
        raise ValueError(f"step {record.get('step')}: no per-member ledgers in this record")
    try:
        return idranges.to_ids(idranges.union_disjoint(record["ledgers"].values()))
    except ValueError as e:
        raise ValueError(f"step {record.get('step')}: members reported overlapping ledgers: {e}") from None


def write_summary(out: str | os.PathLike, status: str, wall_time: float, **extra: Any) -> dict[str, Any]:
    """Write DIR/summary.json from DIR/metrics.jsonl; returns what it wrote."""
    out = Path(out)
    metrics = read_jsonl(out / "metrics.jsonl")
    summary = {
        "status": status,
        "steps": len(metrics),
        "last_step": metrics[-1]["step"] if metrics else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "tokens": sum(m["tokens"] for m in metrics),
        "wall_time": wall_time,
        **extra,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_final(out: str | os.PathLike, replica: int, step: int, checksum: float) -> None:
    """Record this replica's final weights fingerprint (DIR/final/replica<r>.json)."""
    d = Path(out) / "final"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".replica{replica}.tmp"
    tmp.write_text(json.dumps({"replica": replica, "step": step, "weights_checksum": checksum}))
    os.replace(tmp, d / f"replica{replica}.json")


def read_finals(out: str | os.PathLike) -> dict[str, Any]:
    """Summary fields from DIR/final/: every finisher's checksum, and the common one."""
    files = sorted((Path(out) / "final").glob("replica*.json"))
    if not files:
        return {}
    sums = {str(json.loads(f.read_text())["replica"]): json.loads(f.read_text())["weights_checksum"] for f in files}
    extra: dict[str, Any] = {"final_checksums": sums}
    if len(set(sums.values())) == 1:  # replicas that finished hold bit-identical weights
        extra["weights_checksum"] = next(iter(sums.values()))
    return extra
