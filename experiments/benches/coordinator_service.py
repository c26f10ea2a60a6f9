"""The coordinator service benchmark (`recover bench coordinator --service`): the real
membership service against N simulated replicas over loopback.

Contract:
- The coordinator is `core.coordinator.service.CoordinatorService`, the code a run's coordinator
  process serves (core/coordinator/process.py), in a process of its own started from a run's
  config.json and environment (RECOVER_T0, RECOVER_JOIN_TOKEN). Only the c10d store
  that process also hosts is left out: it is idle between generations (communicators
  rendezvous through it only when one forms) and it is the one piece that needs
  torch. Nothing here imports torch.
- The N replicas are simulated by `--clients` processes of
  experiments/benches/replica_clients.py, each holding its share of the N real control
  connections with one selector and speaking the worker's side of the protocol
  (hello with the join token, heartbeats, votes with id-range ledgers, joins after an
  abort). A quota's vote goes out `--step-seconds` after the quota arrived.
- The steps of one run, per N: 2 warm-up steps; `--steady-steps` steps without a
  fault (the window that is measured); then `--crashes` crashes and `--freezes`
  freezes, one per step on distinct seeded replicas, each followed by a clean step.
  A crash closes the replica's connection half a step after its quota arrived (the
  kernel's doing when a worker dies); a freeze keeps it open and silent.
- Measured per N, from what the coordinator itself wrote (the `coordinator` field of
  each commit in metrics.jsonl, events.jsonl) and what the clients saw (time.time(),
  one clock: the same machine):
  * `step_latency_s`: last vote read -> every commit message sent, the service's
    own clock, median (and p95) over the steady steps; `client_step_latency_s`: the
    clients' view, last vote sent -> last commit received;
  * `cpu_share`: the coordinator process's CPU seconds over wall seconds across the
    steady window (commit of the last warm-up step to the last steady commit);
  * `heartbeats_per_s`, `messages_per_s`: heartbeats (all lines) it handled per
    second over that window;
  * `crash_detect_s`: close -> the recovery's `detected_at`, per crash;
    `crash_abort_all_s`: close -> the abort reaching the last survivor;
    `freeze_detect_s`: the frozen replica's last message -> `detected_at`.
  It checks what it measured: the coordinator exited 0 with every step committed,
  and every planned fault fired and was recovered from as the fault it was (a crash
  as a closed connection, a freeze as heartbeat silence).
- Raises the open-file limit to what N connections need (both ends are on this
  machine); one line naming the limit if the hard limit is too low.
- Writes OUT/NAME.json (default coordinator_service) and redraws
  paper_figs/coordinator_scale.py's figure. Nothing here is asserted on: it is a
  measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from recover.core.config.train_config import TrainConfig
from recover.core.coordinator.gc_pacing import take_over
from recover.experiments.coordinator_results import write_results
from recover.core.contract.heartbeat import heartbeat_plan
from recover.core.storage.results import read_jsonl, read_metrics
from recover.core.contract import env_names

from .replica_clients import ClientSpec

REPO = Path(__file__).resolve().parents[2]  # the checkout (experiments/benches/ is two below it)
WARM_STEPS = 2  # step 0 forms generation 0; step 1 settles the clients' timers
FD_SPARE = 64  # files each process holds besides its connections (logs, pipes, the listener)


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"recover: error: --replicas: {need} open files needed, the hard limit is {hard} "
                         "(raise it with ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _plan(N: int, args: argparse.Namespace, rng: random.Random) -> tuple[int, list[dict]]:
    """(steps of the run, its faults): one fault per step after the steady window, each on its own replica."""
    kinds = ["crash"] * args.crashes + ["freeze"] * args.freezes
    victims = rng.sample(range(N), len(kinds))
    first = WARM_STEPS + args.steady_steps
    faults = [{"kind": k, "replica": v, "step": first + 2 * i} for i, (k, v) in enumerate(zip(kinds, victims))]
    return first + 2 * len(kinds) + 1, faults


def _first_line(proc: subprocess.Popen, timeout: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError("the coordinator did not say its port")
    return json.loads(proc.stdout.readline())


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_one(N: int, args: argparse.Namespace, rng: random.Random, work: Path) -> dict:
    """One coordinator, N simulated replicas, one run of the plan; the row of what was measured."""
    steps, faults = _plan(N, args, rng)
    clients = min(args.clients, N)
    out = work / f"n{N}"
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(system="recover", replicas=N, microbatches=args.per_replica * N, steps=steps, out=str(out),
                      heartbeat_interval=args.heartbeat_interval, heartbeat_timeout=args.heartbeat_timeout,
                      heartbeat_budget=args.heartbeat_budget, collective_timeout=args.collective_timeout,
                      startup_timeout=args.startup_timeout)
    cfg.validate()
    (out / "config.json").write_text(json.dumps({"train": cfg.to_dict()}))
    t0, token = time.time(), secrets.token_hex(16)
    env = {**os.environ, env_names.T0: repr(t0), env_names.JOIN_TOKEN: token}
    procs: list[subprocess.Popen] = []
    silence = heartbeat_plan(N, cfg.heartbeat_interval, cfg.heartbeat_timeout, cfg.heartbeat_budget)[1]
    deadline = args.startup_timeout + steps * args.step_seconds * 4 + args.freezes * (silence + 5) + 60
    try:
        with open(out / "coordinator.log", "w") as log:
            coord = subprocess.Popen([sys.executable, "-m", "recover.experiments.benches.coordinator_service", "serve",
                                      str(out / "config.json")], env=env, stdout=subprocess.PIPE, stderr=log,
                                     text=True, cwd=REPO)
        procs.append(coord)
        port = _first_line(coord, 60)["port"]
        for k in range(clients):
            spec = ClientSpec(host="127.0.0.1", port=port, token=token, replicas=list(range(k, N, clients)),
                              step_seconds=args.step_seconds, heartbeat_interval=args.heartbeat_interval,
                              per_replica=args.per_replica, deadline=deadline,
                              faults=[f for f in faults if f["replica"] % clients == k])
            (out / f"client{k}.spec.json").write_text(json.dumps(asdict(spec)))
            with open(out / f"client{k}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "recover.experiments.benches.replica_clients", str(out / f"client{k}.spec.json"),
                     str(out / f"client{k}.json")], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        code = coord.wait(timeout=deadline)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seen = [json.loads((out / f"client{k}.json").read_text()) for k in range(clients)]
    return _measure(N, args, steps, faults, t0, code, out, seen)


def _measure(N: int, args: argparse.Namespace, steps: int, faults: list[dict], t0: float, code: int, out: Path,
             seen: list[dict]) -> dict:
    metrics = {m["step"]: m for m in read_metrics(out / "metrics.jsonl")}
    events = read_jsonl(out / "events.jsonl")
    if code != 0 or sorted(metrics) != list(range(steps)):
        raise RuntimeError(f"N={N}: the coordinator exited {code} with {len(metrics)}/{steps} steps committed "
                           f"(see {out}/coordinator.log)")
    fired = {(f["replica"], f["step"]): f for s in seen for f in s["faults"]}
    recoveries = {e["step"]: e for e in events if e.get("kind") == "recovery"}
    detect = {"crash": [], "freeze": []}
    abort_all, recovery_s = [], []
    for f in faults:
        got, rec = fired.get((f["replica"], f["step"])), recoveries.get(f["step"])
        cause = "control connection closed" if f["kind"] == "crash" else "no heartbeat for"
        if got is None or rec is None or f"replica {f['replica']} lost: {cause}" not in rec["fault"]:
            raise RuntimeError(f"N={N}: planned {f} fired: {got is not None}; recovered as: "
                               f"{rec['fault'] if rec else None}")
        detected = t0 + rec["detected_at"]
        detect[f["kind"]].append(detected - (got["at"] if f["kind"] == "crash" else got["last_sent"]))
        aborts = [s["abort_received"][str(rec["from_generation"])][1] for s in seen
                  if str(rec["from_generation"]) in s["abort_received"]]
        abort_all.append(max(aborts) - got["at"])
        recovery_s.append(rec["recovery_seconds"])
    first, last = metrics[WARM_STEPS - 1], metrics[WARM_STEPS + args.steady_steps - 1]
    a, b = first["coordinator"], last["coordinator"]
    window = last["wall_time"] - first["wall_time"]
    steady = range(WARM_STEPS, WARM_STEPS + args.steady_steps)
    latency = [metrics[s]["coordinator"]["vote_to_commit_s"] for s in steady]
    client_latency = [max(x["commit_received"][str(s)][1] for x in seen if str(s) in x["commit_received"])
                      - max(x["vote_sent"][str(s)] for x in seen if str(s) in x["vote_sent"]) for s in steady]
    interval = statistics.median(x["heartbeat_interval"] for x in seen)  # as the coordinator named it
    end = next(e for e in events if e.get("kind") == "run_end")
    return {
        "replicas": N, "microbatches": args.per_replica * N, "clients": len(seen), "steps": steps,
        "step_seconds": args.step_seconds, "heartbeat_interval": interval,
        "heartbeat_timeout": end["heartbeat_timeout"], "heartbeat_budget": args.heartbeat_budget,
        "max_heartbeat_gap_s": end["max_heartbeat_gap"],
        "step_latency_s": statistics.median(latency), "step_latency_p95_s": _quantile(latency, 0.95),
        "client_step_latency_s": statistics.median(client_latency),
        "window_s": window, "cpu_s": b["cpu_s"] - a["cpu_s"], "cpu_share": (b["cpu_s"] - a["cpu_s"]) / window,
        "heartbeats_per_s": (b["heartbeats"] - a["heartbeats"]) / window,
        "messages_per_s": (b["messages"] - a["messages"]) / window,
        "heartbeats_sent": sum(x["heartbeats_sent"] for x in seen), "heartbeats_handled": last["coordinator"]["heartbeats"],
        "crash_detect_s": detect["crash"], "crash_abort_all_s": abort_all[:len(detect["crash"])],
        "freeze_detect_s": detect["freeze"], "recovery_s": recovery_s,
        "formed_at_s": next((e["at"] for e in events if e.get("kind") == "startup" and "formed" in e), None),
        "samples": {"step_latency_s": latency, "client_step_latency_s": client_latency},
    }


def bench_coordinator_service(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    biggest = max(args.replicas)
    _raise_fd_limit(biggest + FD_SPARE)
    rows = []
    with tempfile.TemporaryDirectory(prefix="coordsvc-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        for N in args.replicas:
            t = time.perf_counter()
            row = run_one(N, args, rng, work)
            rows.append(row)
            print(f"N={N:>5}  step {row['step_latency_s'] * 1e3:7.2f} ms (p95 {row['step_latency_p95_s'] * 1e3:7.2f},"
                  f" clients see {row['client_step_latency_s'] * 1e3:7.2f})  cpu {100 * row['cpu_share']:5.1f}%"
                  f"  {row['heartbeats_per_s']:8.0f} hb/s  crash seen "
                  f"{', '.join(f'{x * 1e3:.1f}' for x in row['crash_detect_s'])} ms  freeze seen "
                  f"{', '.join(f'{x:.2f}' for x in row['freeze_detect_s'])} s  [{time.perf_counter() - t:.0f}s]",
                  flush=True)
    result = {
        "what": "core.coordinator.service.CoordinatorService in its own process against N simulated replicas "
                "(experiments/benches/replica_clients.py) over loopback; per N one run: warm-up, a steady window "
                "without faults, then crashes (connection closed) and freezes (silent, open)",
        "per_replica_microbatches": args.per_replica, "steady_steps": args.steady_steps, "seed": args.seed,
        "cores": os.cpu_count(),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "command": " ".join(["recover", "bench", "coordinator", *sys.argv[3:]]) if len(sys.argv) > 2 else "",
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    write_results(result, Path(args.out), args.name, figure=not args.no_figure)
    return 0


def serve(config: str) -> int:
    """The coordinator process of one bench run: the membership service, as core/coordinator/process.py serves it."""
    from recover.core.coordinator.service import CoordinatorService

    service = CoordinatorService(TrainConfig.load(config), host="127.0.0.1", port=0, stop=threading.Event())
    print(json.dumps({"port": service.port}), flush=True)
    take_over()  # as core/coordinator/process.py does: this process is the coordinator (core/coordinator/gc_pacing.py)
    return service.serve()


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) != 3:
        sys.exit("usage: python -m recover.experiments.benches.coordinator_service serve CONFIG")
    code = serve(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
