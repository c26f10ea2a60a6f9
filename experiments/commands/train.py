"""`recover train`: run one training job with one system on this machine.

Contract: every flag of `TrainConfig` and of the registered systems' settings is
a flag here; all of them are validated (and the fault plan checked against the
run) before anything starts. The run itself is `experiments.run.run_training`;
this module prints its verdict: how each failed process ended, then one line.
Exit 0 when the run is ok, 1 when it failed, 2 for bad input, 7 when the run
directory could not be written (EXIT_RUN_DIR_UNWRITABLE, core/contract/worker_exit.py):
summary.json or config.json failed to write (then the verdict is that one line on
stderr, naming the file, the error and what the run did; no traceback), or the
coordinator stopped the run because its metrics or events could not be written.

`--resume DIR` continues the run in DIR from its last complete checkpoint: its
config.json is the base, flags given now override it (a fault plan only if given
again), and the run's files continue (`run_training(..., resume=True)`). When a
run with checkpoints fails, the last line names its last checkpoint and the
command that resumes from it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.config.train_config import ConfigError, TrainConfig, add_dataclass_flags, dataclass_from_args
from recover.core.contract.worker_exit import EXIT_RUN_DIR_UNWRITABLE
from recover.fault_injection.injector import attach_plan
from recover.fault_injection.plan import PlanError

from ..run import RunDirUnwritable, run_training
from ..systems import SYSTEMS
from . import fail


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="run one training job",
        description="Train the workload with one system on this machine: a coordinator process and "
        "one worker process per replica. Writes DIR/config.json, metrics.jsonl, summary.json, logs/.",
    )
    add_dataclass_flags(p, TrainConfig)
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR (its config.json; flags given override it) from its last "
                        "complete checkpoint (recover)")
    for cls in dict.fromkeys(s.settings for s in SYSTEMS.values() if s.settings):
        add_dataclass_flags(p.add_argument_group("baseline settings", cls.__doc__), cls)
    p.set_defaults(func=cmd_train)


def _resumed_config(args: argparse.Namespace) -> TrainConfig:
    """The config of the run in --resume DIR, with the flags given now on top, at its last checkpoint."""
    out = Path(args.resume)
    try:
        saved = json.loads((out / "config.json").read_text())["train"]
    except (OSError, ValueError, KeyError):
        raise ConfigError("--resume", f"{out} is not a run directory (no readable config.json)") from None
    if args.out is not None and Path(args.out).resolve() != out.resolve():
        raise ConfigError("--out", f"a resumed run continues in its own directory {out}, not {args.out}")
    # The first run's fault plan struck already: a resumed run injects only what it is given.
    saved.update(out=str(out), faults="", hooks="", resume_from="")
    cfg = dataclass_from_args(TrainConfig, args, **TrainConfig.from_dict(saved).to_dict())
    ckpts = CheckpointDir(cfg.checkpoint_root())
    latest = ckpts.latest()
    if latest is None:
        raise ConfigError("--resume", f"{ckpts.root} holds no complete checkpoint to resume from")
    cfg.resume_from = str(ckpts.path(latest))
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    try:
        if args.checkpoint_every is not None and args.checkpoint_every < 1:
            raise ConfigError("--checkpoint-every", f"must be >= 1 (leave it out for no checkpoints), "
                              f"got {args.checkpoint_every}")
        cfg = _resumed_config(args) if args.resume is not None else dataclass_from_args(TrainConfig, args)
        cfg.validate(tuple(SYSTEMS))
        if args.resume is None and cfg.checkpoint_dir and CheckpointDir(cfg.checkpoint_dir).latest() is not None:
            # never mix two runs' checkpoints (a save skips a step already there)
            raise ConfigError("--checkpoint-dir", f"{cfg.checkpoint_dir} holds another run's checkpoints; "
                              "resume that run with --resume, or choose an empty directory")
    except ConfigError as e:
        return fail(str(e))
    system = SYSTEMS[cfg.system]
    settings = dataclass_from_args(system.settings, args) if system.settings else None
    if settings is not None:
        # --checkpoint-every/--checkpoint-keep/--replace-after set the baseline's own settings
        # (config.json's "baseline" section): its recover-side fields stay at their defaults
        cfg.checkpoint_every, cfg.replace_after = 0, -1.0
    try:
        if settings is not None:
            settings.validate(cfg)
    except ConfigError as e:
        return fail(str(e))
    try:
        plan = attach_plan(cfg)  # validated against this run before anything starts
    except PlanError as e:
        return fail(f"--faults: {e}")
    try:
        summary = run_training(cfg, plan=plan, settings=settings, resume=args.resume is not None)
    except RunDirUnwritable as e:
        did = "" if e.summary is None else (f" (the run: {e.summary['status']}, {e.summary['steps']}/{cfg.steps} "
                                            f"steps committed, exit {e.summary['returncode']}: {e.summary['reason']})")
        print(f"recover train: {e}{did}", file=sys.stderr, flush=True)
        return EXIT_RUN_DIR_UNWRITABLE
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
    if summary["status"] != "ok" and cfg.checkpoint_every:
        if summary.get("last_checkpoint"):
            print(f"last checkpoint: {summary['last_checkpoint']} (step {summary['last_checkpoint_step']}); "
                  f"resume with: {summary['resume_command']}")
        else:
            print(f"no checkpoint was completed (one every {cfg.checkpoint_every} steps); nothing to resume from")
    if summary["returncode"] == EXIT_RUN_DIR_UNWRITABLE:
        return EXIT_RUN_DIR_UNWRITABLE
    return 0 if summary["status"] == "ok" else 1
