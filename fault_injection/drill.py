"""A fault drill: rehearse a plan on stand-in workers that walk every hook point, in seconds.

Contract:
- `run_drill(plan, replicas, steps, microbatches, out)` launches, with the real
  core Launcher and the real injector (worker hooks loaded by name, launcher
  hooks by PID), one stand-in worker per replica. A stand-in trains nothing: each
  step it walks this replica's quota (core.contract.policy's equal split) through every
  point of core.launch.hooks.PHASES - forward, backward, between_microbatches,
  allreduce, commit, optimizer_step, checkpoint_save (not state_transfer: only
  a recover admission reaches it, and a drill admits no one) - sleeping `work_seconds`
  for each forward and backward, and calls the hooks as a trainer does (the
  microbatches through the trainers' own loop, core.worker.fold.fold_quota). So every
  fault of a plan, at any phase, happens for real (SIGKILL, SIGSTOP, a raise, a
  straggler's sleep) in a run that starts in well under a second.
- Unlike a plain run, one replica's fault does not end the drill: every replica
  walks on until it ends or its fault stops it, so one drill shows many faults.
- Each stand-in appends every point it reaches to DIR/drill/replica<r>.jsonl
  *before* calling the hook, so a killed or frozen worker's last line is the
  point where its fault fired. Its first line names its pid and the pid of its
  sidecar: a second process in the replica's process group (standing for the
  replica's other ranks) that exits by itself, writing "parent_gone", when its
  worker is gone - unless a replica_loss SIGKILLs the whole group at once.
- The drill ends when every replica has settled: finished, exited, or frozen for
  good by an untimed freeze (a kind that `freezes` in fault_injection.kinds,
  without `seconds`: a hang) (left frozen for `linger` seconds, then the launcher's
  cleanup ends it). It writes DIR/fault_plan.json, faults.jsonl, pids.json and
  summary.json (how each process exited) like a training run.
- No torch is imported anywhere in a drill.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from recover.core.worker.fold import fold_quota
from recover.core.launch.hooks import WorkerHooks, load_hooks
from recover.core.launch.launcher import Launcher, python_module_argv
from recover.core.contract.policy import quota_sizes
from recover.core.storage.results import write_summary
from recover.core.launch.startup import add_worker_flags
from recover.core.contract import env_names

from .injector import WORKER_HOOKS, launcher_hooks, process_state
from .kinds import KINDS
from .plan import FaultPlan, validate_plan
from .record import read_records

MODULE = "recover.fault_injection.drill"


def trace_path(out: str | os.PathLike, replica: int) -> Path:
    return Path(out) / "drill" / f"replica{replica}.jsonl"


def read_trace(out: str | os.PathLike, replica: int) -> list[dict]:
    """The points replica `replica`'s stand-in reached, in order."""
    p = trace_path(out, replica)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class _Trace:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)

    def write(self, **rec) -> None:
        rec["t"] = time.time()
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


class _TracedHooks(WorkerHooks):
    """The run's hooks, with every point traced before it is called (a fault's last line is its point)."""

    def __init__(self, hooks: WorkerHooks, trace: _Trace):
        self.hooks, self.trace = hooks, trace

    def at(self, step: int, phase: str, microbatch: int | None = None) -> None:
        self.trace.write(event="point", step=step, phase=phase, microbatch=microbatch)
        self.hooks.at(step, phase, microbatch)

    def microbatch_done(self, step: int, microbatch: int, seconds: float) -> None:
        start = time.perf_counter()
        self.hooks.microbatch_done(step, microbatch, seconds)  # a straggler sleeps here
        self.trace.write(event="microbatch_done", step=step, microbatch=microbatch, measured=seconds,
                         total=seconds + time.perf_counter() - start)


# ---- the stand-in worker -----------------------------------------------------------------------
def worker(config: str, replica: int) -> int:
    cfg = SimpleNamespace(**json.loads(Path(config).read_text())["train"])
    trace = _Trace(trace_path(cfg.out, replica))
    # The sidecar shares our process group (Popen keeps it), as a replica's other ranks would.
    sidecar = subprocess.Popen(
        python_module_argv(MODULE, "sidecar", "--trace", str(trace_path(cfg.out, replica)) + ".sidecar",
                           "--parent", str(os.getpid()))
    )
    # Like a replica's ranks meeting before training: walk only once the sidecar is up.
    up = Path(str(trace_path(cfg.out, replica)) + ".sidecar")
    deadline = time.monotonic() + 60
    while not (up.exists() and up.read_text()) and sidecar.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    trace.write(event="start", pid=os.getpid(), sidecar_pid=sidecar.pid)
    hooks = _TracedHooks(load_hooks(cfg.hooks, cfg, replica), trace)

    def stand_in_fold(k: int, at) -> None:  # a stand-in's microbatch ids are its indices k
        at("forward", k)
        time.sleep(cfg.work_seconds)
        at("backward", k)
        time.sleep(cfg.work_seconds)

    quota = quota_sizes(cfg.microbatches, list(range(cfg.replicas)))[replica]
    for step in range(cfg.steps):
        fold_quota(step, range(quota), stand_in_fold, hooks)
        try:
            hooks.at(step, "allreduce")
        except Exception as e:  # an injected link failure: a plain worker dies of it too
            trace.write(event="collective_failed", step=step, error=f"{type(e).__name__}: {e}")
            return 1
        for phase in ("commit", "optimizer_step", "checkpoint_save"):
            hooks.at(step, phase)
    trace.write(event="end")
    sidecar.kill()
    sidecar.wait()
    return 0


def sidecar(trace: str, parent: int, max_seconds: float = 120.0) -> int:
    """Stand for another rank of the replica: live while the worker `parent` lives."""
    log = _Trace(Path(trace))
    log.write(event="start", pid=os.getpid())
    end = time.monotonic() + max_seconds
    while time.monotonic() < end:
        if os.getppid() != parent:
            log.write(event="parent_gone")
            return 0
        time.sleep(0.02)
    return 0


# ---- the stand-in coordinator: ends the drill once every replica has settled -------------------
def coordinator(out: str, replicas: int, linger: float, max_seconds: float) -> int:
    print(json.dumps({"host": "127.0.0.1", "store_port": 0, "control_port": 0}), flush=True)
    out_dir = Path(out)
    end = time.monotonic() + max_seconds
    while time.monotonic() < end:
        time.sleep(0.02)
        pids_file = out_dir / "pids.json"
        if not pids_file.exists():
            continue
        try:
            pids = {int(r): ps[0] for r, ps in json.loads(pids_file.read_text())["replicas"].items()}
        except (ValueError, KeyError):  # being written
            continue
        frozen_for_good = {
            r["pid"] for r in read_records(out_dir)
            if r.get("kind") in KINDS and KINDS[r["kind"]].freezes and r.get("seconds") is None
        }
        settled = 0
        for r, pid in pids.items():
            state = process_state(pid)
            trace = read_trace(out_dir, r)
            if state in (None, "Z") or (trace and trace[-1].get("event") == "end"):
                settled += 1
            elif state in ("T", "t") and pid in frozen_for_good:
                settled += 1
        if settled == replicas:
            time.sleep(linger)
            return 0
    print("drill did not settle in time", file=sys.stderr, flush=True)
    return 1


# ---- the driver --------------------------------------------------------------------------------
def run_drill(
    plan: FaultPlan, replicas: int, steps: int, microbatches: int, out: str | os.PathLike,
    work_seconds: float = 0.02, linger: float = 0.5, max_seconds: float = 120.0,
) -> dict:
    """Rehearse `plan` (validated first; raises PlanError) and return the summary it wrote."""
    validate_plan(plan, replicas, steps, microbatches)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("faults.jsonl", "fault_plan.json", "pids.json", "summary.json"):
        (out / name).unlink(missing_ok=True)
    if (out / "drill").exists():  # traces of an earlier drill into the same directory
        for p in (out / "drill").glob("*"):
            p.unlink()
    config = out / "config.json"
    config.write_text(json.dumps({"train": {
        "out": str(out), "replicas": replicas, "steps": steps, "microbatches": microbatches,
        "faults": "", "hooks": WORKER_HOOKS, "work_seconds": work_seconds,
    }}, indent=1))
    t0 = time.time()
    launcher = Launcher(
        out,
        python_module_argv(MODULE, "coordinator", "--out", str(out), "--replicas", str(replicas),
                           "--linger", str(linger), "--max-seconds", str(max_seconds)),
        lambda r: python_module_argv(MODULE, "worker", "--config", str(config), "--replica", str(r)),
        replicas,
        env={env_names.T0: repr(t0)},
        hooks=[launcher_hooks(plan, out, t0)],
        grace_seconds=1.0,  # stand-ins exit at once; only a frozen one waits, and it waits for good
    )
    result = launcher.run()
    return write_summary(
        out, "ok" if result.returncode == 0 else "failed", time.time() - t0, returncode=result.returncode,
        reason=result.reason, processes=[e.__dict__ for e in result.exits],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    add_worker_flags(sub.add_parser("worker"))
    s = sub.add_parser("sidecar")
    s.add_argument("--trace", required=True)
    s.add_argument("--parent", type=int, required=True)  # its worker may be gone before it starts
    c = sub.add_parser("coordinator")
    c.add_argument("--out", required=True)
    c.add_argument("--replicas", type=int, required=True)
    c.add_argument("--linger", type=float, default=1.0)
    c.add_argument("--max-seconds", type=float, default=120.0)
    r = sub.add_parser("run", help="rehearse a plan file")
    r.add_argument("plan")
    r.add_argument("--replicas", type=int, required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--microbatches", type=int, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--work-seconds", type=float, default=0.02)
    r.add_argument("--linger", type=float, default=0.5)
    a = ap.parse_args(argv)
    if a.what == "worker":
        return worker(a.config, a.replica)
    if a.what == "sidecar":
        return sidecar(a.trace, a.parent)
    if a.what == "coordinator":
        return coordinator(a.out, a.replicas, a.linger, a.max_seconds)
    from .plan import load_plan

    summary = run_drill(load_plan(a.plan), a.replicas, a.steps, a.microbatches, a.out, a.work_seconds, a.linger)
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
