"""Where a step's time goes, per worker process: `recover bench iteration --profile`.

Contract:
- Standalone: the standard library only, nothing of `recover` imported. The bench
  copies this file as `sitecustomize.py` into a folder of the run's own, first on its
  PYTHONPATH, followed by one call `install(...)`, so every worker of the run (of
  this tree or of a `--baseline-tree`, which has no such file) wraps the methods
  named in `PATCHES` as their modules are imported. A method a tree lacks is skipped.
- Each wrapped call adds its wall time to the current step's phase; a relay inside a
  replica is named by its message kind (`ReplicaLink.share:id`), a wait on the
  coordinator by what it waits for (`Replica._wait_for:abort+go`), a control message
  by its kind. A step ends with its optimizer step (`CommittedStep.__call__`), so
  "step" is the time from one optimizer step's end to the next one's.
- As the process exits (`os._exit` included: the workers end that way) it writes
  `<out>/<system>-r<replica>-l<local rank>-<pid>.json`: its steps' phases and totals.
- `summarize(folder)`: per role (system, leader = local rank 0, or follower), per
  phase, the mean over processes of the mean ms per step, steps from `skip` on (the
  first ones pay one-time costs). Wrapped calls do not nest, but for one:
  `ShardedAccumulator.load_mean` holds `load_shard_mean` where a tree has it. The
  heartbeat thread's sends (`ControlClient.send:hb`) are off the training thread.
- It measures, it does not judge: time outside the wrapped calls (the loop's own code,
  the fold's bookkeeping) shows only in the step's total, and the wrappers cost about
  a microsecond a call.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import statistics
import sys
import time
from pathlib import Path

# module -> [(class, method, how its phase is named: None, "kind" of a message argument or result, "waits")]
PATCHES = {
    "recover.core.parallel.replica_link": [("ReplicaLink", "share", "kind"), ("ReplicaLink", "combine", None)],
    "recover.core.worker.replica": [("Replica", "_wait_for", "waits")],
    "recover.core.worker.control": [("ControlClient", "send", "kind")],
    "recover.core.worker.comm": [("Communicator", "allreduce", None), ("Communicator", "build", None)],
    "recover.core.parallel.fsdp": [("ShardedAccumulator", m, None) for m in
                                   ("weights_bit_sums", "pack", "load_mean", "load_shard_mean", "fold")],
    "recover.core.worker.accumulator": [("GradAccumulator", m, None) for m in
                                        ("weights_fingerprint", "pack", "load_mean", "fold")],
    "recover.core.worker.recipe": [("CommittedStep", "__call__", None)],
    "recover.core.training.workload": [("Workload", "forward_backward", None)],
}
STEP_END = ("CommittedStep", "__call__")


class _Recorder:
    def __init__(self, out: str, replica_env: str, local_env: str):
        self.out, self.replica_env, self.local_env = out, replica_env, local_env
        self.steps: list[dict[str, float]] = [{}]
        self.totals: list[float] = []
        self.mark = time.perf_counter()
        self.written = False

    def wrap(self, cls, method: str, naming: str | None) -> None:
        f = getattr(cls, method, None)
        if f is None:
            return
        name = f"{cls.__name__}.{method}"
        step_end = (cls.__name__, method) == STEP_END
        rec = self

        @functools.wraps(f)
        def timed(*args, **kw):
            t = time.perf_counter()
            result = None
            try:
                result = f(*args, **kw)
                return result
            finally:
                now = time.perf_counter()
                key = name
                if naming == "kind":
                    msg = args[1] if len(args) > 1 and args[1] is not None else result
                    key += f":{msg.get('t')}" if isinstance(msg, dict) else ""
                elif naming == "waits" and len(args) > 1:
                    key += ":" + "+".join(sorted(args[1]))
                d = rec.steps[-1]
                d[key] = d.get(key, 0.0) + now - t
                if step_end:
                    rec.totals.append(now - rec.mark)
                    rec.mark = now
                    rec.steps.append({})

        setattr(cls, method, timed)

    def write(self) -> None:
        if self.written or not self.totals:
            return
        self.written = True
        system = "plain" if any("plain" in a for a in sys.argv) else "recover"
        replica, local = os.environ.get(self.replica_env, "?"), os.environ.get(self.local_env, "0")
        path = Path(self.out) / f"{system}-r{replica}-l{local}-{os.getpid()}.json"
        path.write_text(json.dumps({"system": system, "replica": replica, "local": local,
                                    "steps": self.steps[:-1], "totals": self.totals}))


def install(out: str, replica_env: str, local_env: str) -> None:
    """Wrap PATCHES' methods in this process as their modules load; write the phases at exit."""
    rec = _Recorder(out, replica_env, local_env)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in PATCHES:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module, load=load, name=name):
                load(module)
                for cls, method, naming in PATCHES[name]:
                    if hasattr(module, cls):
                        rec.wrap(getattr(module, cls), method, naming)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
    import atexit
    atexit.register(rec.write)
    exit_now = os._exit

    def _exit(code, exit_now=exit_now):  # the workers end with os._exit, which skips atexit
        try:
            rec.write()
        finally:
            exit_now(code)

    os._exit = _exit


def summarize(folder: str | Path, skip: int = 2) -> dict:
    """{role: {"step": ms, phase: ms, ...}}: per role, the mean over its processes of each
    phase's mean ms per step (steps from `skip` on), and of the median step."""
    roles: dict[str, list[dict]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        j = json.loads(path.read_text())
        if len(j["totals"]) <= skip:
            continue
        roles.setdefault(f"{j['system']}-{'leader' if j['local'] == '0' else 'follower'}", []).append(j)
    out = {}
    for role, procs in roles.items():
        phases = sorted({n for j in procs for s in j["steps"][skip:] for n in s})
        row = {"step": statistics.mean(statistics.median(j["totals"][skip:]) for j in procs) * 1000}
        for n in phases:
            row[n] = statistics.mean(statistics.mean(s.get(n, 0.0) for s in j["steps"][skip:]) for j in procs) * 1000
        out[role] = dict(sorted(row.items(), key=lambda kv: -kv[1]))
    return out


def site_source(out: str | Path, replica_env: str, local_env: str) -> str:
    """The text of a `sitecustomize.py` that installs this profile into every process of a run."""
    return Path(__file__).read_text() + f"\n\ninstall({str(out)!r}, {replica_env!r}, {local_env!r})\n"
