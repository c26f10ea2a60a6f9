"""`recover train`: run one training job with one system on this machine.

Contract: every flag of `TrainConfig` and of the registered systems' settings is
a flag here; all of them are validated (and the fault plan checked against the
run) before anything starts. The run itself is `experiments.run.run_training`;
this module prints its verdict: how each failed process ended, then one line.
Exit 0 when the run is ok, 1 when it failed, 2 for bad input.
"""
from __future__ import annotations

import argparse
import sys

from recover.core.config import ConfigError, TrainConfig, add_dataclass_flags, dataclass_from_args
from recover.fault_injection.injector import attach_plan
from recover.fault_injection.plan import PlanError

from ..run import run_training
from ..systems import SYSTEMS
from . import fail


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="run one training job",
        description="Train the workload with one system on this machine: a coordinator process and "
        "one worker process per replica. Writes DIR/config.json, metrics.jsonl, summary.json, logs/.",
    )
    add_dataclass_flags(p, TrainConfig)
    for cls in dict.fromkeys(s.settings for s in SYSTEMS.values() if s.settings):
        add_dataclass_flags(p.add_argument_group("baseline settings", cls.__doc__), cls)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(TrainConfig, args)
    try:
        cfg.validate(tuple(SYSTEMS))
    except ConfigError as e:
        return fail(str(e))
    system = SYSTEMS[cfg.system]
    settings = dataclass_from_args(system.settings, args) if system.settings else None
    try:
        if settings is not None:
            settings.validate(cfg)
    except ConfigError as e:
        return fail(str(e))
    try:
        plan = attach_plan(cfg)  # validated against this run before anything starts
    except PlanError as e:
        return fail(f"--faults: {e}")
    summary = run_training(cfg, plan=plan, settings=settings)
    for e in summary["processes"]:
        if e["returncode"] not in (0, None) and not (e["role"] == "coordinator" and summary["status"] == "ok"):
            who = "coordinator" if e["replica"] < 0 else f"replica {e['replica']}"
            print(f"  {who} (pid {e['pid']}) {e['how']} at {e['at']:.2f}s", file=sys.stderr)
    loss = summary["final_loss"]
    print(
        f"{summary['status']}: {summary['steps']}/{cfg.steps} steps, final loss "
        f"{'n/a' if loss is None else f'{loss:.4f}'}, {summary['tokens']} tokens, "
        f"{summary['wall_time']:.1f}s -> {cfg.out}"
        + (f" ({summary['reason']})" if summary["reason"] else "")
    )
    return 0 if summary["status"] == "ok" else 1
