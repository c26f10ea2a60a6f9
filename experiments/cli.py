"""The `recover` command line.

Contract: every subcommand validates all of its input before it starts any process;
a bad value ends the command at once with one line, `recover: error: --flag: why`,
and exit code 2. Subcommands register themselves in `COMMANDS`.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from recover.core.config import ConfigError, TrainConfig, add_dataclass_flags, dataclass_from_args
from recover.core.launcher import Launcher, describe_exit, python_module_argv
from recover.core.results import read_finals, read_jsonl, write_summary
from recover.fault_injection.injector import attach_plan, launcher_hooks
from recover.fault_injection.plan import FaultPlan, PlanError

from .progress import MetricsProgress
from .systems import SYSTEMS

# Files a run owns in its --out directory; a new run into the same directory
# replaces them so results never mix two runs.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "events.jsonl", "faults.jsonl",
             "fault_plan.json", "pids.json")


def fail(message: str) -> int:
    print(f"recover: error: {message}", file=sys.stderr)
    return 2


# ---- train -------------------------------------------------------------------------
def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="run one training job",
        description="Train the workload with one system on this machine: a coordinator process and "
        "one worker process per replica. Writes DIR/config.json, metrics.jsonl, summary.json, logs/.",
    )
    add_dataclass_flags(p, TrainConfig)
    for cls in dict.fromkeys(s.settings for s in SYSTEMS.values() if s.settings):
        add_dataclass_flags(p.add_argument_group("baseline settings", cls.__doc__), cls)
    p.set_defaults(func=cmd_train)


def resolved_config_dict(cfg: TrainConfig) -> dict:
    import torch

    from dataclasses import asdict

    return {
        "train": cfg.to_dict(),
        "model": asdict(cfg.gpt_config()),
        "system": {"name": cfg.system, "description": SYSTEMS[cfg.system].description},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "backend": cfg.resolved_backend(), "device": cfg.resolved_device()},
    }


def run_training(cfg: TrainConfig, extra_hooks=(), plan: FaultPlan | None = None, settings=None) -> dict:
    """Launch `cfg` (already validated) and write its summary; returns the summary.

    With a fault `plan` (from `attach_plan(cfg)`), it is saved as DIR/fault_plan.json
    before any worker starts, and its launcher-side hooks join `extra_hooks`.
    `settings`: the system's own settings (its defaults if None), in config.json.
    """
    system = SYSTEMS[cfg.system]
    if settings is None and system.settings is not None:
        settings = system.settings()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "final", ignore_errors=True)
    config_path = out / "config.json"
    config = resolved_config_dict(cfg)
    if settings is not None:
        config["baseline"] = settings.to_dict()
    config_path.write_text(json.dumps(config, indent=2))
    progress = MetricsProgress(cfg.out, cfg.steps, enabled=cfg.progress and sys.stderr.isatty())
    t0 = time.time()
    if plan is not None:
        extra_hooks = [*extra_hooks, launcher_hooks(plan, out, t0)]
    launcher = Launcher(
        out,
        python_module_argv("recover.core.coordinator", "--config", str(config_path), "--mode", system.coordinator_mode),
        lambda r: python_module_argv(system.worker_module, "--config", str(config_path), "--replica", str(r)),
        cfg.replicas,
        env={"RECOVER_T0": repr(t0)},
        hooks=[progress, *extra_hooks],
        fail_fast=system.fail_fast,
    )
    supervise = system.load_supervisor()
    if supervise is not None:  # a restarting baseline runs its own sequence of launches
        result = supervise(cfg, settings, config_path, launcher.env, launcher.hooks)
    else:
        result = launcher.run()
    progress.close()
    status = "ok" if result.returncode == 0 else "failed"
    ends = [e for e in read_jsonl(out / "events.jsonl") if e.get("kind") == "run_end"]
    if status == "failed" and ends and ends[-1]["code"] != 0:
        result.reason = ends[-1]["reason"]  # the coordinator's own words beat its exit code
    done = len(read_jsonl(out / "metrics.jsonl"))
    if status == "ok" and done < cfg.steps:
        status, result.reason = "failed", f"only {done} of {cfg.steps} steps committed"
    return write_summary(
        out, status, time.time() - t0, returncode=result.returncode, reason=result.reason,
        processes=[e.__dict__ for e in result.exits], **{**read_finals(out), **getattr(result, "summary_extra", {})},
    )


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


COMMANDS: list[Callable] = [add_train_parser]

from .cli_faults import add_faults_parser  # noqa: E402 - its own module; registered here

COMMANDS.append(add_faults_parser)

from .bench import add_bench_parser  # noqa: E402

COMMANDS.append(add_bench_parser)

from .launch_cmd import add_launch_parser  # noqa: E402

COMMANDS.append(add_launch_parser)

from .cli_simulate import add_simulate_parser  # noqa: E402 - the simulator's command, its own module

COMMANDS.append(add_simulate_parser)

from .cli_experiment import add_experiment_parser, add_figs_parser  # noqa: E402 - experiment grids, figures

COMMANDS += [add_experiment_parser, add_figs_parser]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="recover",
        description="ReCoVer: resilient LLM pre-training, its baselines, fault injection and experiments.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
