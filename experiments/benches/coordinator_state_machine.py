"""The coordinator benchmark (`recover bench coordinator`): the state machine's cost against R.

Contract:
- It drives the coordinator's real state machine (`core.coordinator.protocol.ProtocolStateMachine`) in
  this process, with R replicas of `--per-replica` microbatches each (M = that * R),
  for each R of `--replicas`. No sockets, no workers: what it measures is the
  coordinator's own work per step, which every replica of a run waits on.
- Every inbound message is made the way a worker makes it and parsed the way the
  membership service parses it (one JSON line, `core.contract.wire.parse_line`: orjson and
  the field checks); the vote's ledger is
  the quota the replica was handed, as the worker reports it after folding all of it.
  Votes and rejoins arrive in a seeded random order.
- Per R it measures, `--repeats` times each (the figure is the median):
  * `commit_s`: one step's R votes, parse + `on_vote`, up to and including the
    commit (the last vote's call returns the commit and the next quotas), each
    line parsed and handed over at once as the service does; also split into
    `commit_parse_s` (core.contract.wire.read_line of the R lines: the JSON parse and the
    field checks the service makes, timed in a pass of its own)
    and `commit_machine_s` (the rest);
  * `recovery_s`: one crash mid-step (`on_lost`: the abort), then the R-1
    survivors' rejoins, parse + `on_join`, up to and including the new generation
    and its quotas; split the same way (`recovery_parse_s`, `recovery_machine_s`);
  * `*_encode_s` and `*_bytes_out`: encoding what those calls answered, every
    message to a worker and every record, as the service does (`core.contract.wire.dumps`, a broadcast once);
  * `vote_bytes` / `join_bytes`: the size of one inbound message, on the wire.
  * `machine_over_parse`: commit_machine_s / commit_parse_s, a ratio taken in the
    same run (these machines are noisy and shared: absolute times move with the
    load, ratios much less): the state machine's cost in units of parsing the votes.
  The collector is paced as in the coordinator's process (`core.coordinator.gc_pacing.take_over`:
  no automatic collection, one at each settle, which comes after a round, untimed).
  `--no-gc` runs with Python's cyclic garbage collector disabled altogether, settles
  only freezing, to show what share of the cost is left to collection.
  It checks what it measured: each commit round ends in exactly one commit of the
  step's M ids, each recovery round in exactly one new generation.
- Writes OUT/NAME.json (NAME: `--name`, default coordinator_state_machine) and
  draws paper_figs/coordinator_scale.py's log-log figure from OUT (into paper_figs/
  for results/bench, into OUT otherwise).
  Nothing here is asserted on: it is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from recover.core.coordinator.gc_pacing import settle, take_over
from recover.core.contract.iteration import iteration_range
from recover.core.contract.policy import quota_of
from recover.core.coordinator.protocol import ProtocolStateMachine, Out
from recover.core.storage.results import step_ids_are
from recover.core.contract.wire import dumps, parse_line, read_line
from recover.experiments.coordinator_results import write_results


def _wire(msg: dict) -> bytes:
    """One message as it travels: a JSON line (core.contract.wire's codec, as core.membership sends it)."""
    return dumps(msg) + b"\n"


def _encode(outs: list[Out]) -> tuple[float, int]:
    """Seconds and bytes to encode what the state machine answered, as the service would."""
    start = time.perf_counter()
    n = 0
    last, size = None, 0
    for a in outs:
        if a.kind == "send":  # a broadcast (one message object) is encoded once, as the service does
            if a.msg is not last:
                last, size = a.msg, len(_wire(a.msg))
            n += size
        elif a.kind in ("commit", "recovery"):
            n += len(_wire(a.msg))  # the metrics / events line
    return time.perf_counter() - start, n


def _parse_and_feed(lines: list[tuple[int, bytes]], handler, now: float) -> tuple[list[Out], float, float]:
    """Each replica's line parsed and checked (core.contract.wire.read_line) and handed to the state
    machine at once, as the service does (core/coordinator/service.py `_read`: the vote is still in
    the cache when the state machine reads it): (what it answered, seconds parsing, seconds in the state machine). The
    parse is timed alone in a pass of its own over the same lines; the state machine's
    share is the interleaved total less that."""
    start = time.perf_counter()
    for _, line in lines:
        read_line(line)
    parse_s = time.perf_counter() - start
    outs: list[Out] = []
    start = time.perf_counter()
    for r, line in lines:
        msg, why = read_line(line)  # a vote comes read into its class (core/contract/step_messages.py)
        if msg is None:
            raise RuntimeError(f"replica {r}'s line was refused: {why}")
        outs += handler(r, msg, now)
    return outs, parse_s, time.perf_counter() - start - parse_s


def _quotas(outs: list[Out], kind: str, members) -> dict[int, object]:
    """Each replica's quota from the messages of that kind, as its worker reads it (policy.quota_of:
    a shared message names the ids all share); `members`: the generation's, as range list."""
    return {a.replica: quota_of(a.msg, a.msg.get("members", members), a.replica)
            for a in outs if a.kind == "send" and a.msg.get("t") == kind}


class _Run:
    """One coordinator and the R replicas it serves (their quotas, as they were told)."""

    def __init__(self, R: int, M: int, rng: random.Random):
        self.R, self.M, self.rng = R, M, rng
        self.proto = ProtocolStateMachine(R, M, 10**9, join_timeout=30.0, now=0.0)
        self.now = 0.0
        start = time.perf_counter()
        outs: list[Out] = []
        for r in range(R):
            msg, _ = parse_line(_wire({"t": "hello", "replica": r, "pid": 1000 + r, "tokens_per_mb": 1024,
                                       "token": "bench"}))
            outs += self.proto.on_hello(r, msg, self.now)
        self.formation_s = time.perf_counter() - start
        self.quota = _quotas(outs, "gen", None)
        if self.proto.state != "running" or len(self.quota) != R:
            raise RuntimeError(f"R={R}: generation 0 did not form")

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def commit(self) -> dict:
        p = self.proto
        step, members = p.step, list(self.quota)
        lines = [(r, _wire({"t": "vote", "gen": p.gen, "step": step, "ok": True, "ledger": self.quota[r],
                             "loss_sum": 2.5 * self.M / len(members), "mb_seconds": 0.25, "lr": 1e-3}))
                 for r in members]
        self.rng.shuffle(lines)
        now = self._tick()
        outs, parse_s, machine_s = _parse_and_feed(lines, p.on_vote, now)
        commits = [a for a in outs if a.kind == "commit"]
        if len(commits) != 1 or not step_ids_are(commits[0].msg, *iteration_range(step, self.M)):
            raise RuntimeError(f"R={self.R}: step {step} did not commit exactly its M ids")
        enc_s, enc_b = _encode(outs)
        self.quota = _quotas(outs, "commit", p.member_ranges)
        return {"s": parse_s + machine_s, "parse_s": parse_s, "machine_s": machine_s, "encode_s": enc_s,
                "bytes_out": enc_b, "msg_bytes": len(lines[0][1])}

    def recovery(self) -> dict:
        p = self.proto
        victim = self.rng.choice(sorted(self.quota))
        survivors = [r for r in self.quota if r != victim]
        now = self._tick()
        start = time.perf_counter()
        outs = p.on_lost(victim, "bench: crashed", now)
        machine_s = time.perf_counter() - start
        aborts = [a for a in outs if a.kind == "send" and a.msg.get("t") == "abort"]
        if len(aborts) != len(survivors):
            raise RuntimeError(f"R={self.R}: the crash did not abort the generation")
        nxt = aborts[0].msg["next"]
        # Mid-step: each survivor had folded its whole quota; it rejoins with that ledger.
        lines = [(r, _wire({"t": "join", "gen": nxt, "step": p.step, "ledger": self.quota[r]})) for r in survivors]
        self.rng.shuffle(lines)
        joined, parse_s, join_s = _parse_and_feed(lines, p.on_join, now)
        outs += joined
        machine_s += join_s
        gens = _quotas(outs, "gen", None)
        if p.state != "running" or p.gen != nxt or set(gens) != set(survivors):
            raise RuntimeError(f"R={self.R}: the survivors did not form generation {nxt}")
        enc_s, enc_b = _encode(outs)
        # The survivors' ledgers stay; their new quotas are the dead replica's ids. After
        # folding those too, what each reports is old ledger + redo quota: the next commit
        # round sends exactly that (as the worker's accumulator would hold it).
        self.quota = {r: _join_ledgers(self.quota[r], gens[r]) for r in survivors}
        return {"s": parse_s + machine_s, "parse_s": parse_s, "machine_s": machine_s, "encode_s": enc_s,
                "bytes_out": enc_b, "msg_bytes": len(lines[0][1])}


def _join_ledgers(kept, redo):
    """What a survivor's vote reports after a redo: the ids it kept plus its redo quota."""
    return list(kept) + list(redo)


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def bench_coordinator(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    rows = []
    if args.no_gc:
        gc.disable()
    else:
        take_over()  # as the coordinator's process does: collections at its settles (core/coordinator/gc_pacing.py)
    for R in args.replicas:
        M = args.per_replica * R
        t0 = time.perf_counter()
        run = _Run(R, M, rng)
        commits, recoveries = [], []
        settle()
        for _ in range(args.repeats):
            # settle() after each round, untimed, as the service does after each commit it applies
            commits.append(run.commit())
            settle()
            recoveries.append(run.recovery())
            settle()
            run.commit()  # the redo's commit: the run goes on (not timed as a plain commit)
            settle()
        row = {
            "replicas": R, "microbatches": M, "formation_s": run.formation_s,
            "commit_s": _median(commits, "s"), "commit_parse_s": _median(commits, "parse_s"),
            "commit_machine_s": _median(commits, "machine_s"), "commit_encode_s": _median(commits, "encode_s"),
            "commit_bytes_out": _median(commits, "bytes_out"), "vote_bytes": _median(commits, "msg_bytes"),
            "recovery_s": _median(recoveries, "s"), "recovery_parse_s": _median(recoveries, "parse_s"),
            "recovery_machine_s": _median(recoveries, "machine_s"), "recovery_encode_s": _median(recoveries, "encode_s"),
            "recovery_bytes_out": _median(recoveries, "bytes_out"), "join_bytes": _median(recoveries, "msg_bytes"),
            "machine_over_parse": _median(commits, "machine_s") / _median(commits, "parse_s"),
            "samples": {"commit_s": [c["s"] for c in commits], "recovery_s": [c["s"] for c in recoveries]},
        }
        rows.append(row)
        print(f"R={R:>6} M={M:>7}  commit {row['commit_s'] * 1e3:9.2f} ms (parse {row['commit_parse_s'] * 1e3:7.2f},"
              f" machine {row['commit_machine_s'] * 1e3:7.2f}; + encode {row['commit_encode_s'] * 1e3:7.2f})"
              f"  recovery {row['recovery_s'] * 1e3:9.2f} ms (parse {row['recovery_parse_s'] * 1e3:7.2f},"
              f" machine {row['recovery_machine_s'] * 1e3:7.2f}; + encode {row['recovery_encode_s'] * 1e3:8.2f})"
              f"  vote {row['vote_bytes']} B  [{time.perf_counter() - t0:.1f}s]", flush=True)
    result = {
        "what": "coordinator state machine (core.coordinator.protocol.ProtocolStateMachine) in process: one commit = R votes parsed "
                "from JSON + on_vote; one recovery round = on_lost + R-1 rejoins parsed + on_join; medians of "
                "`repeats`; parse: core.contract.wire.parse_line (orjson when installed, and the field checks); *_encode_s: core.contract.wire.dumps of what those calls answered",
        "gc": "off" if args.no_gc else "paced (core.coordinator.gc_pacing.take_over)", "per_replica_microbatches": args.per_replica, "repeats": args.repeats, "seed": args.seed,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "command": " ".join(["recover", "bench", "coordinator", *sys.argv[3:]]) if len(sys.argv) > 2 else "",
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    gc.enable()
    write_results(result, Path(args.out), args.name, figure=not args.no_figure)
    return 0
