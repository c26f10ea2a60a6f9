"""The results contract every system writes, and experiment grids and figures read.

Contract (DIR = the run's --out):
- DIR/config.json: {"train": the full resolved TrainConfig, "model": the resolved
  model shape, plus each system's own settings}.
- DIR/metrics.jsonl: one JSON object per committed iteration, in step order, each
  step at most once, with at least: step (from 0), loss (the iteration's mean
  microbatch loss), tokens, microbatch_id_ranges (the ids folded into that step's
  gradient, as a canonical id range list `[[start, stop], ...]`: core/contract/idranges.py),
  generation, members (replica ids that took part), wall_time (seconds since the
  run started), and lr (the learning rate that step used, as the replicas that
  committed it reported it). recover's coordinator also writes each member's
  ledger (the id ranges that member's vote reported folding), and derives
  microbatch_id_ranges from their union; `reported_ids` recomputes that union for
  a reader, so a check of the ids rests on what the workers said, not on what the
  coordinator handed out; and `coordinator`, its own load at that commit (latency
  from the last vote, CPU seconds, lines handled: core/coordinator/service.py), and
  `progress_gap`, the longest gap between two units of work any member had measured
  (seconds; what a restarted coordinator waits for the members' reports in proportion to).
- Members and ledgers, compact (recover's lines): a step's line does not grow with
  R. `member_ranges` is the members as an id range list, and the ledgers are
  run-length encoded, losslessly: `ledger_runs` [[first_member, n, first_id, k],
  ...] says that the n consecutive members first_member.. each reported one range
  of k ids, back to back from first_id; `ledger_rest` {member: ranges} holds every
  other member's ledger as it was voted (a survivor that redid a lost share holds
  two ranges). Equal quotas are one or two runs whatever R is: about 200 bytes a
  step where the plain dict and member list were 0.85 MB at 16,384 replicas. How
  many ids a member folded is its ledger's size (the line no longer repeats it).
  Lines written before carry `members` (a list), `ledgers` {member: ranges} and
  `folded` {member: count}; `read_metrics` gives every line, old or new, those
  three keys (`expand_members`), so a reader handles one shape.
- A step's ids, old lines and new: lines written before the ids became ranges
  carry `microbatch_ids`, the sorted plain id list, instead of
  `microbatch_id_ranges`. A line holds one or the other, never both. Readers go
  through `step_id_ranges(line)` / `step_ids(line)` (or `step_ids_are(line, lo,
  hi)`), which accept either, so results committed in the old form read and
  aggregate to the same numbers. Ranges, not a list: a step's ids are a few
  contiguous runs (all M of them in one pair when no id was dropped), so the
  line no longer grows with M (a plain list was about 1 MB a step at 16,384
  replicas). A new key rather than a new type under the old one: a reader that
  does not know the change fails on the missing key, instead of silently taking
  pairs for ids (`len`, a comparison with a plain list).
- DIR/summary.json: steps done, final loss, tokens, wall time, exit status.
- DIR/events.jsonl (systems that recover): one object per recovery or restart;
  recover's coordinator adds one per refused control message ("kind": "refused",
  with the peer and what was refused) and a last "run_end" line.
- DIR/final/replica<r>.json: {"replica", "step", "weights_checksum"} written by each
  replica that finished the run (`write_final`); summary.json then carries
  `weights_checksum` when all of them agree (and `final_checksums` always).
Lines are appended and flushed one at a time, so a crash loses at most the line
being written; readers skip a torn last line.
- A run directory that cannot be written (full, over quota, gone read-only) does not
  end recover's run with a traceback: the coordinator writes metrics.jsonl and
  events.jsonl through `HeldLineWriter`, which keeps the lines it could not write in
  memory, in order, and writes them (each whole, once) as soon as a later attempt
  succeeds. The run goes on rather than stopping, because a full disk is often
  transient (a cleanup, a quota raised) and the training state lives in the workers,
  not in these files: stopping would throw away work that a few kilobytes of memory
  keep. The hold is bounded (`MAX_HELD_LINES` per file): past it the coordinator stops
  the run (exit code 7, core/contract/worker_exit.py); a crash loses what is held.
  A reader meanwhile sees the file end at the last line written (at most a torn
  last line, completed later in place, never a line twice or out of order).
- summary.json is written whole or not at all (a temp file renamed over it).

Changing this contract (a key renamed, moved or packed: the compact members line broke
`make demo` once, because one reader still parsed raw lines), in the same change:
1. this docstring, and docs/recipe.md's table of the files;
2. every reader: `git grep -n '"KEY"'` and `git grep -n metrics.jsonl` over core/,
   baselines/, experiments/, paper_figs/ and benchmarks/; a reader of metrics.jsonl goes
   through `read_metrics` (or `parse_metrics_line` when tailing), never `read_jsonl` or
   `json.loads` (tests/test_metrics_readers.py runs each reader over compact lines and
   reads the source for raw readers: add a new reader there);
3. old lines still read: committed results keep the form they were written in, so the
   reader accepts both (as `expand_members` and `step_id_ranges` do);
4. `make demo` runs to its verdict lines (CI checks them);
5. `recover figs` and the aggregation over results/ give the same figures and CSVs
   (`git diff --stat results/ paper_figs/` shows no change, or the change is explained).
"""
from __future__ import annotations

import collections
import errno
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

from recover.core.contract import idranges

IDS = "microbatch_id_ranges"  # a step's ids on a metrics line (a canonical range list)
OLD_IDS = "microbatch_ids"  # the plain sorted id list that lines carried before
METRIC_FIELDS = ("step", "loss", "tokens", IDS, "generation", "members", "wall_time", "lr")


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


MAX_HELD_LINES = 10_000  # per file: a few MB of metrics lines; past it the run stops rather than grow


class HeldLineWriter:
    """An append-only JSON-lines file whose failed writes are held, not raised (see the contract).

    `write(record)` queues the line and writes every held line, oldest first; an OSError
    (ENOSPC, EDQUOT, EFBIG, EIO, ...) leaves the rest held and is kept as `error`, never
    raised. Lines go through an unbuffered file with os-level writes, so a short write
    (a disk that fills mid-line) is continued from the byte it stopped at: nothing is
    written twice, nothing out of order. `flush()` retries without a new line (the
    coordinator calls it on a timer, so space that comes back is used without waiting
    for the next commit). `over_bound` says more than `max_held` lines are held: the
    owner decides what that means (recover's coordinator stops the run). The file is
    opened at the first write, so a directory that cannot even create it is a held
    write too; a file that ends in a torn line (a writer killed mid-line) gets a
    newline first, so the next record starts a line of its own.
    `file`: a file object to write to instead of opening `path` (tests), anything with
    `write(bytes) -> int`."""

    def __init__(self, path: str | os.PathLike, max_held: int = MAX_HELD_LINES, file: Any = None):
        self.path = Path(path)
        self.max_held = max_held
        self._f = file
        self._held: collections.deque[bytes] = collections.deque()
        self._done = 0  # bytes of the oldest held line already on disk (a short write's)
        self.error: OSError | None = None  # the last failure, None once everything held is written
        self.failing_since: float | None = None  # time.monotonic() of the first failure of this spell
        self.written = 0  # lines written since this writer was made

    @property
    def held(self) -> int:
        """Lines waiting to be written."""
        return len(self._held)

    @property
    def over_bound(self) -> bool:
        return len(self._held) > self.max_held

    def write(self, record: dict[str, Any]) -> bool:
        """Queue one record and write what is held; True when nothing is left held."""
        self._held.append((json.dumps(record) + "\n").encode())
        return self.flush()

    def flush(self) -> bool:
        """Write the held lines, oldest first, until one fails; True when none is left."""
        try:
            if self._f is None:
                self._f = self._open()
            while self._held:
                line = self._held[0]
                while self._done < len(line):
                    n = self._f.write(line[self._done:])
                    if not n:  # (a regular file never does this; a loop must not spin on it)
                        raise OSError(errno.EIO, f"{self.path}: a write wrote nothing")
                    self._done += n
                self._held.popleft()
                self._done = 0
                self.written += 1
        except OSError as e:
            self.error = e
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            return False
        self.error, self.failing_since = None, None
        return True

    def _open(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+b", buffering=0)  # readable too: its last byte is looked at
        try:
            size = os.fstat(f.fileno()).st_size
            if size and os.pread(f.fileno(), 1, size - 1) != b"\n":
                self._held.appendleft(b"\n")  # end the torn line: it is skipped by readers, the next is whole
        except OSError:
            f.close()
            raise
        return f

    def close(self) -> bool:
        """A last attempt to write what is held, then the file is closed; True when nothing is lost."""
        ok = self.flush()
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
        return ok


MEMBER_RANGES, LEDGER_RUNS, LEDGER_REST = "member_ranges", "ledger_runs", "ledger_rest"


def pack_members(members: Iterable[int], ledgers: dict[str, idranges.Ranges]) -> dict[str, Any]:
    """A step's members and their voted ledgers ({str(member): ranges}) in the line's
    compact form (see the contract): O(runs + irregular members), not O(R)."""
    runs: list[list[int]] = []
    rest: dict[str, idranges.Ranges] = {}
    for m in sorted(int(k) for k in ledgers):
        ledger = ledgers[str(m)]
        if len(ledger) == 1:
            a, b = ledger[0]
            if runs:
                first, n, start, k = runs[-1]
                if m == first + n and b - a == k and a == start + n * k:
                    runs[-1][1] += 1  # the next member, the next k ids
                    continue
            runs.append([m, 1, a, b - a])
        else:
            rest[str(m)] = ledger
    return {MEMBER_RANGES: idranges.from_ids(sorted(members)), LEDGER_RUNS: runs, LEDGER_REST: rest}


def expand_members(record: dict[str, Any]) -> dict[str, Any]:
    """The line with `members` (a sorted list), and where it reports ledgers, `ledgers`
    ({str(member): ranges}) and `folded` ({str(member): ids folded}), from either form.
    Lines that already have them (older lines, plain's and the baselines') are returned as they are."""
    if MEMBER_RANGES not in record:
        return record
    ledgers: dict[str, Any] = {}
    for first, n, start, k in record.get(LEDGER_RUNS, []):
        for i in range(n):
            ledgers[str(first + i)] = [[start + i * k, start + (i + 1) * k]]
    ledgers.update(record.get(LEDGER_REST, {}))
    out = {**record, "members": idranges.to_ids(record[MEMBER_RANGES])}
    if LEDGER_RUNS in record:
        out["ledgers"] = {str(m): ledgers[str(m)] for m in sorted(int(k) for k in ledgers)}
        out["folded"] = {m: idranges.count(lg) for m, lg in out["ledgers"].items()}
    return out


METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """metrics.jsonl's whole lines, each with `members` (and `ledgers`, `folded` where
    reported) whichever form it was written in (`expand_members`)."""
    return [expand_members(r) for r in _read_records(path)]


def parse_metrics_line(line: str) -> dict[str, Any]:
    """One metrics.jsonl line, for a reader that tails the file: as `read_metrics` gives it."""
    return expand_members(json.loads(line))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All whole records of a JSON-lines file ([] if it does not exist).

    Refuses metrics.jsonl (ValueError): its lines come in two forms, and a reader that
    indexes a raw line's `members`, `ledgers` or `folded` breaks on the compact one. The
    demo once did, and nothing caught it; `read_metrics` gives every line one shape."""
    if Path(path).name == METRICS_FILE:
        raise ValueError(f"{path}: read metrics lines with read_metrics (or parse_metrics_line), "
                         "which expands their compact form")
    return _read_records(path)


def _read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
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
    path = Path(out) / METRICS_FILE
    records = _read_records(path)  # rewritten as they were written: the compact form stays compact
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
    """One metrics.jsonl line; `t0` is the run's start on the time.time() clock.

    `ids`: the step's distinct ids (ValueError on a duplicate: an id folded twice is a bug
    the writer must not record as one step)."""
    return {
        "step": step, "loss": loss, "tokens": tokens, IDS: idranges.from_ids(ids),
        "generation": generation, "members": sorted(members), "wall_time": time.time() - t0, **extra,
    }


def step_id_ranges(record: dict[str, Any]) -> idranges.Ranges:
    """A metrics line's ids as a canonical range list, from either form (see the contract).

    Two lines name the same ids exactly when their `step_id_ranges` are equal."""
    if IDS in record:
        return idranges.union_disjoint([idranges.check(record[IDS])])  # canonical, O(pairs)
    if OLD_IDS in record:
        return idranges.from_ids(record[OLD_IDS])
    raise ValueError(f"step {record.get('step')}: the line carries no ids ({IDS} or {OLD_IDS})")


def step_ids(record: dict[str, Any]) -> list[int]:
    """A metrics line's ids, sorted, from either form (O(ids): prefer `step_id_ranges` for large M)."""
    return idranges.to_ids(step_id_ranges(record))


def step_ids_are(record: dict[str, Any], start: int, stop: int) -> bool:
    """Whether a metrics line's ids are exactly [start, stop): a step that folded all its M ids."""
    return idranges.is_exactly(step_id_ranges(record), start, stop)


def reported_ids(record: dict[str, Any]) -> list[int]:
    """The sorted ids a committed step's members reported folding (its `ledgers`' union).

    ValueError if two members reported the same id (a double-counted microbatch)
    or the record carries no per-member ledgers (a system that does not report them)."""
    record = expand_members(record)
    if "ledgers" not in record:
        raise ValueError(f"step {record.get('step')}: no per-member ledgers in this record")
    try:
        return idranges.to_ids(idranges.union_disjoint(record["ledgers"].values()))
    except ValueError as e:
        raise ValueError(f"step {record.get('step')}: members reported overlapping ledgers: {e}") from None


def write_summary(out: str | os.PathLike, status: str, wall_time: float, **extra: Any) -> dict[str, Any]:
    """Write DIR/summary.json from DIR/metrics.jsonl; returns what it wrote (OSError if it
    could not: the file is then left as it was)."""
    out = Path(out)
    metrics = read_metrics(out / METRICS_FILE)
    summary = {
        "status": status,
        "steps": len(metrics),
        "last_step": metrics[-1]["step"] if metrics else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "tokens": sum(m["tokens"] for m in metrics),
        "wall_time": wall_time,
        **extra,
    }
    # whole or not at all: a full disk leaves the old summary (or none), never a torn one
    tmp = out / ".summary.json.tmp"
    try:
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, out / "summary.json")
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return summary


def write_final(out: str | os.PathLike, replica: int, step: int, checksum: float, digest: str | None = None,
                shard_digests: list[str] | None = None) -> None:
    """Record this replica's final weights fingerprint (DIR/final/replica<r>.json); `digest`, when
    given, is the sha256 of every weight's bytes (core.worker.accumulator.weights_digest);
    `shard_digests`, a replica of many ranks', each rank's sha256 of its local shards, by local rank."""
    d = Path(out) / "final"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".replica{replica}.tmp"
    rec: dict[str, Any] = {"replica": replica, "step": step, "weights_checksum": checksum}
    if digest is not None:
        rec["weights_digest"] = digest
    if shard_digests is not None:
        rec["shard_digests"] = list(shard_digests)
    tmp.write_text(json.dumps(rec))
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
