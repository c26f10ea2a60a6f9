"""`recover faults ...`: generate, check and rehearse fault plans.

Contract (as every `recover` subcommand): all input is checked before anything
runs; a bad value ends the command with one line, `recover: error: --flag: why`
(or `recover: error: PLAN: fault i: field: why`), and exit code 2.
- `recover faults sample` writes a plan drawn from a seed and a failure model
  (fault_injection.generate); the same arguments always write the same plan.
- `recover faults check PLAN` validates a plan against a run's shape.
- `recover faults drill PLAN` rehearses a plan on stand-in workers that walk
  every hook point without training (fault_injection.drill), and prints where
  each fault fired.
"""
from __future__ import annotations

import argparse
import sys

from recover.fault_injection.generate import DEFAULT_PHASES, MODELS, SAMPLE_KINDS, sample_plan
from recover.fault_injection.plan import PlanError, load_plan, validate_plan

from . import fail


def _run_shape(p: argparse.ArgumentParser, microbatches_required: bool = False) -> None:
    p.add_argument("--replicas", type=int, required=True, help="replicas R of the run")
    p.add_argument("--steps", type=int, required=True, help="steps of the run")
    p.add_argument("--microbatches", type=int, required=microbatches_required, default=None,
                   help="microbatches M per step")


def add_parser(sub) -> None:
    p = sub.add_parser("faults", help="generate, check and rehearse fault plans",
                       description=__doc__.split("\n")[0])
    fsub = p.add_subparsers(dest="faults_command", required=True, metavar="ACTION")

    s = fsub.add_parser(
        "sample", help="write a fault plan drawn from a seed",
        description="Draw a fault plan from a failure model and a seed (the same seed always gives the "
        "same plan): independent per-GPU failures with exponential or Weibull lifetimes of mean "
        "--mtbf-hours over --hours of simulated time, or 'spread': lose --lose of the replicas evenly "
        "spread over the run (the paper's schedule, half of them by default).",
    )
    s.add_argument("--model", choices=MODELS, default="spread", help="failure model (default: spread)")
    s.add_argument("--replicas", type=int, required=True, help="replicas R of the run")
    s.add_argument("--steps", type=int, required=True, help="steps of the run")
    s.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    s.add_argument("--mtbf-hours", type=float, default=1000.0, help="mean time between failures of one GPU")
    s.add_argument("--shape", type=float, default=1.0, help="Weibull shape (1 = exponential)")
    s.add_argument("--hours", type=float, default=24.0, help="simulated hours the run spans")
    s.add_argument("--gpus-per-replica", type=int, default=1, help="GPUs per replica (a GPU failure loses its replica)")
    s.add_argument("--lose", type=int, default=None, help="spread: replicas to lose (default: half)")
    s.add_argument("--kind", choices=SAMPLE_KINDS, default="crash", help="what each failure does (default: crash)")
    s.add_argument("--hang-seconds", type=float, default=None, help="hang: seconds frozen (default: for good)")
    s.add_argument("--phases", default=",".join(DEFAULT_PHASES), help="comma-separated phases to draw from")
    s.add_argument("--out", default="-", help="plan file to write ('-': standard output)")
    s.set_defaults(func=cmd_sample)

    c = fsub.add_parser("check", help="validate a plan against a run's shape")
    c.add_argument("plan", help="fault plan JSON file")
    _run_shape(c)
    c.set_defaults(func=cmd_check)

    d = fsub.add_parser(
        "drill", help="rehearse a plan on stand-in workers (no training)",
        description="Run the plan's faults for real (SIGKILL, SIGSTOP, ...) against stand-in workers "
        "that walk every hook point of an iteration, and print where each fault fired.",
    )
    d.add_argument("plan", help="fault plan JSON file")
    _run_shape(d, microbatches_required=True)
    d.add_argument("--out", required=True, help="directory for faults.jsonl, summary.json, drill/ traces")
    d.add_argument("--work-seconds", type=float, default=0.02, help="sleep standing in for a forward or backward")
    d.set_defaults(func=cmd_drill)


def _check_shape(a: argparse.Namespace) -> str | None:
    for name in ("replicas", "steps", "microbatches"):
        v = getattr(a, name, None)
        if v is not None and v < 1:
            return f"--{name}: must be >= 1, got {v}"
    return None


def cmd_sample(a: argparse.Namespace) -> int:
    if (err := _check_shape(a)) is not None:
        return fail(err)
    from recover.core.launch.hooks import PHASES

    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if not phases or bad:
        return fail(f"--phases: unknown phase {bad[0] if bad else '(none)'!r}; from {', '.join(PHASES)}")
    checks = [("--mtbf-hours", a.mtbf_hours > 0), ("--shape", a.shape > 0), ("--hours", a.hours > 0),
              ("--gpus-per-replica", a.gpus_per_replica >= 1),
              ("--hang-seconds", a.hang_seconds is None or a.hang_seconds > 0)]
    for flag, ok in checks:
        if not ok:
            return fail(f"{flag}: must be > 0")
    if a.lose is not None and not 0 <= a.lose <= a.replicas:
        return fail(f"--lose: must be in 0..{a.replicas} (the replicas of the run), got {a.lose}")
    plan = sample_plan(
        a.model, a.replicas, a.steps, a.seed, mtbf_hours=a.mtbf_hours, shape=a.shape, hours=a.hours,
        gpus_per_replica=a.gpus_per_replica, lose=a.lose, kind=a.kind, hang_seconds=a.hang_seconds,
        phases=phases,
    )
    if a.out == "-":
        print(plan.to_json())
    else:
        plan.save(a.out)
        print(f"{len(plan.faults)} faults ({a.model}, seed {a.seed}) -> {a.out}", file=sys.stderr)
    return 0


def _load_checked(a: argparse.Namespace):
    plan = load_plan(a.plan)
    validate_plan(plan, a.replicas, a.steps, a.microbatches)
    return plan


def cmd_check(a: argparse.Namespace) -> int:
    if (err := _check_shape(a)) is not None:
        return fail(err)
    try:
        plan = _load_checked(a)
    except PlanError as e:
        return fail(f"{a.plan}: {e}")
    print(f"ok: {len(plan.faults)} faults fit a run of {a.replicas} replicas x {a.steps} steps")
    return 0


def cmd_drill(a: argparse.Namespace) -> int:
    if (err := _check_shape(a)) is not None:
        return fail(err)
    if a.microbatches < a.replicas:
        return fail(f"--microbatches: M={a.microbatches} is less than --replicas R={a.replicas}")
    try:
        plan = _load_checked(a)
    except PlanError as e:
        return fail(f"{a.plan}: {e}")
    from recover.fault_injection.drill import run_drill
    from recover.fault_injection.record import read_records

    summary = run_drill(plan, a.replicas, a.steps, a.microbatches, a.out, a.work_seconds)
    fired = {r["index"]: r for r in read_records(a.out)}
    print(f"{'#':>3}  {'kind':<16} {'replica':>7}  {'planned':<34} fired")
    for i, f in enumerate(plan.faults):
        planned = f"at {f.at_seconds}s" if f.wall_clock else f"step {f.step} {f.phase}" + (
            f" mb {f.microbatch}" if f.microbatch is not None else "")
        r = fired.get(i)
        where = "not fired" if r is None else (
            f"{r['wall_time']:.2f}s pid {r['pid']}"
            + (f" step {r['step']} {r['phase']}" + (f" mb {r['microbatch']}" if r["microbatch"] is not None else "")
               if r["step"] is not None else " (by the launcher)"))
        print(f"{i:>3}  {f.kind:<16} {f.replica:>7}  {planned:<34} {where}")
    for e in summary["processes"]:
        who = "coordinator" if e["replica"] < 0 else f"replica {e['replica']}"
        print(f"  {who} (pid {e['pid']}) {e['how']} at {e['at']:.2f}s")
    print(f"{len(fired)} of {len(plan.faults)} faults fired -> {a.out}/faults.jsonl")
    return 0
