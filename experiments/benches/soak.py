"""The soak benchmark (`recover bench soak`): the coordinator's state machine over a long run.

Contract:
- It drives the coordinator's real state machine (`core.coordinator.protocol.ProtocolStateMachine`) in
  this process for `--steps` steps, R replicas (`--replicas`) of `--per-replica`
  microbatches each (M = that * R). No sockets, no workers, no clock: each worker's
  side is played here as core/worker/replica.py plays it (fold the quota it was dealt,
  `ready`, `vote` with its ledger; after an abort, `join` with the ledger it kept; a
  newcomer's `healed` once admitted; the first vote after an admitting generation
  carries a weights digest).
- Every `--every` steps a member is lost in the middle of its step (`on_lost`, after
  it and the others folded their quotas: the survivors rejoin and redo its share),
  and a new process says hello for its slot (`can_heal`): it is admitted at the next
  commit, healed from a donor, and votes from then on. So a 100,000-step run with
  `--every 1000` sees 100 losses and 100 admissions: a replacement every hour of a
  run of 36 s steps.
- It checks what it drives: every step commits once, in order, with exactly its M
  ids (`core.storage.results.step_ids_are` on the metrics line), every loss is followed by
  an admission, and the run ends with `done`.
- Every `--sample-every` steps it samples: steps per second over the window, the
  size of every container the state machine holds (`container_sizes`: each dict,
  list, set and array attribute of the ProtocolStateMachine and of the objects it holds, one
  level down), the process's RSS (VmRSS) and open file descriptors (/proc/self/fd),
  Python's live object count (gc.get_objects) and the size of the last metrics
  line as the service would write it (core.contract.wire.dumps).
- Writes OUT/soak.json (`--name`): the parameters, the samples, and a summary: the
  first and last window's steps per second, RSS and fds at the first and the last
  sample, and each container's size at the first sample, its largest and its last
  (`grown`: the containers whose last size exceeds their largest in the first half
  of the run). Nothing here is asserted on beyond the checks above: it is a
  measurement; tests/test_soak.py asserts the bound on the counts over a short run.
- With `--launcher-starts N` it also soaks the launcher (`core.launch.launcher.Launcher`, the
  process that starts a replacement in a dead replica's slot): N worker processes started
  in turn through the path a replacement takes (`_start_rank`, logs appended to the slot's
  file) and reaped, the launcher's RSS and open descriptors sampled every `--sample-every`
  / 100 starts; under "launcher" in the JSON. A replacement every hour of a 100,000-step
  run of 36 s steps is 1,000 starts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from recover.core.contract import idranges
from recover.core.contract.policy import quota_of
from recover.core.contract.step_messages import Ready, Vote
from recover.core.coordinator.protocol import ProtocolStateMachine, Out
from recover.core.storage.results import step_ids_are
from recover.core.contract.wire import dumps

DIGEST = "soak-weights"  # every replica holds the same weights: the digests agree


def container_sizes(obj: Any, prefix: str = "", depth: int = 1) -> dict[str, int]:
    """The size of every container attribute of `obj` (dicts, lists, sets, tuples, arrays), and of
    the attributes of the objects it holds, `depth` levels down: what could grow with a run."""
    out: dict[str, int] = {}
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if n not in names]
    for name in names:
        try:
            v = getattr(obj, name)
        except AttributeError:
            continue
        key = prefix + name
        if isinstance(v, (dict, list, set, frozenset, tuple)):
            out[key] = len(v)
        elif hasattr(v, "size") and hasattr(v, "shape"):  # a numpy array
            out[key] = int(v.size)
        elif depth > 0 and (hasattr(v, "__dict__") or hasattr(type(v), "__slots__")) and not callable(v):
            out.update(container_sizes(v, key + ".", depth - 1))
    return out


def _rss_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


class Soak:
    """One coordinator state machine and the workers it serves, played in process."""

    def __init__(self, replicas: int, per_replica: int, steps: int, every: int, seed: int = 0):
        self.R, self.M, self.S, self.every = replicas, per_replica * replicas, steps, every
        self.rng = random.Random(seed)
        self.now = 0.0
        self.proto = ProtocolStateMachine(self.R, self.M, steps, join_timeout=30.0, now=0.0)
        self.quota: dict[int, idranges.Ranges] = {}  # what each worker was dealt and has not folded yet
        self.held: dict[int, idranges.Ranges] = {}  # what each worker folded this step (its ledger)
        self.digest_next: set[int] = set()  # workers whose next vote carries the weights digest
        self.to_heal: set[int] = set()  # newcomers named in a gen message's heal, not healed yet
        self.next_pid = 10_000
        self.committed = 0  # steps committed, checked in order
        self.losses = self.admissions = 0
        self.line_bytes = 0  # the last metrics line, as written
        self.finished: Out | None = None
        outs: list[Out] = []
        for r in range(self.R):
            outs += self.proto.on_hello(r, self._hello(r), self.now)
        self._absorb(outs)
        if self.proto.state != "running":
            raise RuntimeError("generation 0 did not form")

    def _hello(self, r: int, can_heal: bool = False) -> dict:
        self.next_pid += 1
        msg = {"t": "hello", "replica": r, "pid": self.next_pid, "tokens_per_mb": 1024, "weights_sha256": DIGEST}
        if can_heal:
            msg.update(can_heal=True, started_at=self.now)
        return msg

    def _absorb(self, outs: list[Out]) -> None:
        """Carry out what the state machine answered: each worker takes its messages, the lines are checked."""
        p = self.proto
        for a in outs:
            if a.kind == "send":
                m, r = a.msg, a.replica
                t = m.get("t")
                if t == "gen":
                    self.quota[r] = quota_of(m, m["members"], r)
                    self.held.setdefault(r, [])
                    if m.get("heal") or m.get("digest"):
                        self.digest_next.add(r)  # the generation's first vote carries the digest
                    if m.get("heal") and any(a <= r < b for a, b in m["heal"]["joining"]):
                        self.to_heal.add(r)  # a newcomer: its state arrives from the donor
                elif t == "commit":
                    self.held[r] = []
                    self.quota[r] = [] if "next" in m else quota_of(m, p.member_ranges, r)
                elif t in ("stop",):
                    raise RuntimeError(f"the run stopped: {m.get('reason')}")
            elif a.kind == "close":
                self.quota.pop(a.replica, None)
                self.held.pop(a.replica, None)
                self.digest_next.discard(a.replica)
                self.to_heal.discard(a.replica)
            elif a.kind == "commit":
                line = a.msg
                s = line["step"]
                if s != self.committed or not step_ids_are(line, s * self.M, (s + 1) * self.M):
                    raise RuntimeError(f"step {s} committed out of order or without exactly its M ids")
                self.committed += 1
                self.line_bytes = len(dumps(line)) + 1
            elif a.kind == "event" and a.msg.get("kind") == "admitted":
                self.admissions += len(a.msg["replicas"])
            elif a.kind == "finish":
                self.finished = a
                if a.code != 0:
                    raise RuntimeError(f"the run ended with code {a.code}: {a.reason}")

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def step(self) -> None:
        """One step, to its commit: with a loss mid-step (and its replacement's hello) every `every` steps."""
        p = self.proto
        step = p.step
        lose = self.every > 0 and step > 0 and step % self.every == 0 and len(p.members) > 1
        while p.step == step and self.finished is None:
            now = self._tick()
            outs: list[Out] = []
            for r in self.to_heal & p.member_set:
                outs += p.on_healed(r, {"t": "healed", "gen": p.gen, "step": step, "donor": 0, "bytes": 1,
                                        "seconds": 0.01, "weights_fingerprint": DIGEST}, now)
                self.to_heal.discard(r)
            members = list(p.members)
            for r in members:  # fold the quota dealt
                if self.quota.get(r):
                    self.held[r] = idranges.union_disjoint([self.held[r], self.quota[r]])
                    self.quota[r] = []
            if lose:
                lose = False
                victim = self.rng.choice(members)
                self.losses += 1
                outs += p.on_lost(victim, "soak: replica lost", now)
                self._absorb(outs)
                # the survivors rejoin with what they folded; the generation re-forms on their ledgers
                nxt = p.next_gen
                outs = []
                for r in [m for m in members if m != victim]:
                    outs += p.on_join(r, {"t": "join", "gen": nxt, "step": step, "ledger": self.held[r]}, now)
                # a new process in the victim's slot: admitted at the next commit
                outs += p.on_hello(victim, self._hello(victim, can_heal=True), now)
                self._absorb(outs)
                continue
            for r in members:
                outs += p.on_ready(r, Ready(p.gen, step), now)
            for r in members:
                digest = DIGEST if r in self.digest_next else None
                self.digest_next.discard(r)
                vote = Vote(p.gen, step, True, self.held[r], 2.5 * self.M / len(members),
                            mb_seconds=0.25 * (1 + 0.05 * self.rng.random()), lr=1e-3, weights_fingerprint=digest)
                outs += p.on_vote(r, vote, now)
            self._absorb(outs)
            if p.step == step and self.finished is None and p.state != "forming":
                raise RuntimeError(f"step {step} neither committed nor failed")


def sample(soak: Soak, window_steps: int, window_s: float) -> dict[str, Any]:
    return {"step": soak.proto.step, "steps_per_s": window_steps / window_s if window_s > 0 else None,
            "rss_kib": _rss_kib(), "fds": _fds(), "gc_objects": len(gc.get_objects()),
            "metrics_line_bytes": soak.line_bytes, "losses": soak.losses, "admissions": soak.admissions,
            "members": len(soak.proto.members), "containers": container_sizes(soak.proto)}


def run_soak(replicas: int, per_replica: int, steps: int, every: int, sample_every: int, seed: int = 0,
             echo: bool = False) -> dict[str, Any]:
    """Drive the run; its samples and summary (see the module contract)."""
    soak = Soak(replicas, per_replica, steps, every, seed)
    samples = [sample(soak, 0, 0.0)]
    t0 = time.perf_counter()
    last_t, last_step = t0, soak.proto.step
    while soak.finished is None:
        soak.step()
        if soak.proto.step % sample_every == 0 or soak.finished is not None:
            t = time.perf_counter()
            samples.append(sample(soak, soak.proto.step - last_step, t - last_t))
            last_t, last_step = time.perf_counter(), soak.proto.step  # the sampling itself is not timed
            if echo:
                s = samples[-1]
                print(f"step {s['step']:>8}  {s['steps_per_s']:9.0f} steps/s  rss {s['rss_kib']} KiB  fds {s['fds']}"
                      f"  objects {s['gc_objects']}  line {s['metrics_line_bytes']} B  losses {s['losses']}"
                      f"  admitted {s['admissions']}", flush=True)
    if soak.committed != steps:
        raise RuntimeError(f"{soak.committed} of {steps} steps committed")
    if soak.admissions != soak.losses:
        raise RuntimeError(f"{soak.losses} replicas lost, {soak.admissions} newcomers admitted")
    half = [s for s in samples if s["step"] <= steps // 2] or samples[:1]
    containers = {}
    for k in samples[-1]["containers"]:
        early = max(s["containers"].get(k, 0) for s in half)
        containers[k] = {"first": samples[0]["containers"].get(k, 0), "max": max(s["containers"].get(k, 0)
                                                                              for s in samples),
                         "last": samples[-1]["containers"][k], "max_first_half": early}
    timed = [s for s in samples if s["steps_per_s"]]
    return {
        "steps": steps, "replicas": replicas, "microbatches": soak.M, "every": every, "sample_every": sample_every,
        "seed": seed, "losses": soak.losses, "admissions": soak.admissions,
        "seconds": time.perf_counter() - t0, "samples": samples,
        "summary": {
            "steps_per_s_first": timed[0]["steps_per_s"] if timed else None,
            "steps_per_s_last": timed[-1]["steps_per_s"] if timed else None,
            "rss_kib_first": samples[0]["rss_kib"], "rss_kib_last": samples[-1]["rss_kib"],
            "fds_first": samples[0]["fds"], "fds_last": samples[-1]["fds"],
            "gc_objects_first": samples[0]["gc_objects"], "gc_objects_last": samples[-1]["gc_objects"],
            "metrics_line_bytes_max": max(s["metrics_line_bytes"] for s in samples),
            "containers": containers,
            "grown": sorted(k for k, c in containers.items() if c["last"] > c["max_first_half"]),
        },
    }


def run_launcher_soak(starts: int, sample_every: int, work: Path, echo: bool = False) -> dict[str, Any]:
    """Start and reap `starts` workers through the launcher's replacement path; its RSS and fds."""
    from recover.core.launch.launcher import Launcher

    (work / "logs").mkdir(parents=True, exist_ok=True)
    launcher = Launcher(work, [sys.executable, "-c", "pass"], lambda r: [sys.executable, "-c", "pass"], 2,
                        fork_workers=False)
    samples = [{"starts": 0, "rss_kib": _rss_kib(), "fds": _fds()}]
    t0 = time.perf_counter()
    for i in range(1, starts + 1):
        proc = launcher._start_rank(i % 2, 0, dict(os.environ))
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"start {i}: the worker exited {proc.returncode}")
        if i % sample_every == 0 or i == starts:
            samples.append({"starts": i, "rss_kib": _rss_kib(), "fds": _fds()})
            if echo:
                print(f"launcher: {i:>6} starts  rss {samples[-1]['rss_kib']} KiB  fds {samples[-1]['fds']}",
                      flush=True)
    return {"starts": starts, "seconds": time.perf_counter() - t0, "samples": samples,
            "summary": {"rss_kib_first": samples[0]["rss_kib"], "rss_kib_last": samples[-1]["rss_kib"],
                        "fds_first": samples[0]["fds"], "fds_last": samples[-1]["fds"],
                        "fds_max": max(s["fds"] for s in samples)}}


def bench_soak(args: argparse.Namespace) -> int:
    result = run_soak(args.replicas, args.per_replica, args.steps, args.every, args.sample_every, args.seed,
                      echo=True)
    if getattr(args, "launcher_starts", 0):
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            result["launcher"] = run_launcher_soak(args.launcher_starts, max(1, args.sample_every // 100),
                                                   Path(work), echo=True)
    result.update(
        what="coordinator state machine (core.coordinator.protocol.ProtocolStateMachine) in process for a long run: a member lost "
             "mid-step and a newcomer admitted every `every` steps; steps/s per sample window, the state "
             "machine's container sizes, the process's RSS and open fds, Python's live objects",
        machine={"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        command=" ".join(["recover", "bench", "soak", *sys.argv[3:]]) if len(sys.argv) > 2 else "",
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    s = result["summary"]
    print(f"{result['steps']} steps in {result['seconds']:.1f}s: {s['steps_per_s_first']:.0f} -> "
          f"{s['steps_per_s_last']:.0f} steps/s, rss {s['rss_kib_first']} -> {s['rss_kib_last']} KiB, fds "
          f"{s['fds_first']} -> {s['fds_last']}, grown: {s['grown'] or 'none'}; wrote {path}")
    if "launcher" in result:
        ls = result["launcher"]["summary"]
        print(f"launcher: {result['launcher']['starts']} starts: rss {ls['rss_kib_first']} -> {ls['rss_kib_last']} "
              f"KiB, fds {ls['fds_first']} -> {ls['fds_last']} (max {ls['fds_max']})")
    return 0
