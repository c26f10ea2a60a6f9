"""Running one training job on this machine: what `recover train`, the demo, the benchmarks and the grids share.

Contract:
- `run_training(cfg, ...)` takes a validated `TrainConfig`, clears the files a run
  owns in cfg.out (`RUN_FILES`, and final/) so results never mix two runs, writes
  DIR/config.json (`resolved_config_dict`, plus the system's settings), launches
  the coordinator and one worker per replica (or the system's own supervisor for
  systems that restart or re-form their job), and writes DIR/summary.json, whose
  dict it returns. A fault plan is saved as DIR/fault_plan.json before any worker
  starts. A fresh run also clears DIR/checkpoints (recover's default checkpoint
  root, which the run owns).
- `run_training(cfg, resume=True)` (cfg.resume_from set: `recover train --resume`)
  continues the run's files instead: metrics.jsonl keeps the steps before the
  checkpoint's and drops those after it (they are redone), so it holds every step
  once; events.jsonl gets a "resume" record (from_step, checkpoint, dropped_steps);
  checkpoints.jsonl and the checkpoints stay; leftovers of saves killed midway
  (.tmp dirs) are deleted, since nothing of the old run can be writing.
  wall_time starts again from 0 with the resumed run.
- With checkpoints on, summary.json names the last complete checkpoint
  (last_checkpoint, last_checkpoint_step) and the command that resumes from it
  (resume_command).
- Its verdict is what the processes and files say: "ok" only if the job exited 0
  and metrics.jsonl holds every one of cfg.steps steps; a failing coordinator's
  own reason (events.jsonl's run_end) beats its exit code.
- A run directory that cannot be written (full, over quota) ends `run_training` with
  `RunDirUnwritable` (an OSError naming the file and the error, and carrying the
  summary it could not write, if it got that far), never another traceback: the
  caller says it in one line (`recover train` then exits 7, EXIT_RUN_DIR_UNWRITABLE in
  core/contract/worker_exit.py). Stopping, not going on, because this process writes
  only at the start (config.json, before anything runs) and at the end (summary.json,
  after everything ran): there is nothing to go on with, and what the run did is in
  metrics.jsonl and the checkpoints (the coordinator holds its own lines while the
  directory is full: core/coordinator/service.py). A coordinator that stopped the run
  for its directory (exit 7) gives the run its reason, as its run_end line would.
- It imports nothing of the command line: commands, the demo and submitit jobs
  call it; it calls none of them.
"""
from __future__ import annotations

import importlib.metadata
import json
import platform
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.config.train_config import TrainConfig
from recover.core.launch.end_policy import CoordinatorEnds, FailFast
from recover.core.launch.launcher import Launcher, python_module_argv
from recover.core.storage.results import JsonlWriter, read_finals, read_jsonl, read_metrics, truncate_metrics, write_summary
from recover.core.contract.worker_exit import EXIT_CHECKPOINTS_FAILED, EXIT_RUN_DIR_UNWRITABLE
from recover.fault_injection.injector import launcher_hooks
from recover.fault_injection.plan import FaultPlan
from recover.core.contract import env_names
from recover.core.launch.coordinator_command import MODULE as COORDINATOR, coordinator_args

from .progress import MetricsProgress
from .systems import SYSTEMS

# Files a run owns in its --out directory; a new run into the same directory
# replaces them so results never mix two runs.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "events.jsonl", "faults.jsonl",
             "fault_plan.json", "pids.json", "checkpoints.jsonl")
# What a resumed run continues rather than replaces.
RESUMED_FILES = ("metrics.jsonl", "events.jsonl", "checkpoints.jsonl")


class RunDirUnwritable(OSError):
    """A file of the run directory could not be written: `path`, the OSError `error`, and the
    `summary` that was not written (None before the run started)."""

    def __init__(self, path: Path, error: OSError, summary: dict | None = None):
        super().__init__(error.errno, f"cannot write {path}: {error}")
        self.path, self.error, self.summary = path, error, summary

    def __str__(self) -> str:
        return f"cannot write {self.path}: {self.error}"


def resolved_config_dict(cfg: TrainConfig) -> dict:
    """DIR/config.json: the run's config, its model, its system and the environment it ran in."""
    return {
        "train": cfg.to_dict(),
        "model": asdict(cfg.gpt_config()),
        "system": {"name": cfg.system, "description": SYSTEMS[cfg.system].description},
        "environment": {"torch": importlib.metadata.version("torch"), "python": platform.python_version(),
                        "backend": cfg.resolved_backend(), "device": cfg.resolved_device()},
    }


def _continue_files(cfg: TrainConfig) -> None:
    """A resumed run's files: metrics up to the checkpoint's step, a "resume" record, no stray temp dirs."""
    out = Path(cfg.out)
    dropped = truncate_metrics(out, cfg.start_step)
    CheckpointDir(cfg.checkpoint_root()).remove_temps()
    events = JsonlWriter(out / "events.jsonl")
    events.write({"kind": "resume", "from_step": cfg.start_step, "checkpoint": cfg.resume_from,
                  "dropped_steps": [m["step"] for m in dropped], "at": 0.0})
    events.close()


def _checkpoint_summary(cfg: TrainConfig) -> dict:
    """The last complete checkpoint and the command that resumes from it ({} if checkpoints are off)."""
    if not cfg.checkpoint_every:
        return {}
    ckpts = CheckpointDir(cfg.checkpoint_root())
    latest = ckpts.latest()
    if latest is None:
        return {"last_checkpoint": None}
    return {"last_checkpoint": str(ckpts.path(latest)), "last_checkpoint_step": latest,
            "resume_command": f"recover train --resume {shlex.quote(cfg.out)}"}


def run_training(cfg: TrainConfig, extra_hooks=(), plan: FaultPlan | None = None, settings=None,
                 resume: bool = False) -> dict:
    """Launch `cfg` (already validated) and write its summary; returns the summary.

    With a fault `plan` (from `attach_plan(cfg)`), it is saved as DIR/fault_plan.json
    before any worker starts, and its launcher-side hooks join `extra_hooks`.
    `settings`: the system's own settings (its defaults if None), in config.json.
    `resume`: continue the run's files from cfg.resume_from's step (see the contract).
    """
    system = SYSTEMS[cfg.system]
    if settings is None and system.settings is not None:
        settings = system.settings()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if not (resume and name in RESUMED_FILES):
            (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "final", ignore_errors=True)
    if resume:
        try:
            _continue_files(cfg)
        except OSError as e:
            raise RunDirUnwritable(Path(e.filename) if e.filename else out, e) from None
    elif not cfg.checkpoint_dir:
        CheckpointDir(cfg.checkpoint_root()).remove_all()  # the run owns DIR/checkpoints
    config_path = out / "config.json"
    config = resolved_config_dict(cfg)
    if settings is not None:
        config["baseline"] = settings.to_dict()
    try:
        config_path.write_text(json.dumps(config, indent=2))
    except OSError as e:  # before any process started: nothing to stop
        raise RunDirUnwritable(config_path, e) from None
    progress = MetricsProgress(cfg.out, cfg.steps, enabled=cfg.progress and sys.stderr.isatty())
    t0 = time.time()
    if plan is not None:
        try:
            extra_hooks = [*extra_hooks, launcher_hooks(plan, out, t0)]
        except OSError as e:
            raise RunDirUnwritable(Path(e.filename) if e.filename else out, e) from None
    launcher = Launcher(
        out,
        python_module_argv(COORDINATOR, *coordinator_args(config_path, system.coordinator_mode)),
        lambda r: python_module_argv(system.worker_module, "--config", str(config_path), "--replica", str(r)),
        cfg.replicas,
        env={env_names.T0: repr(t0)},
        hooks=[progress, *extra_hooks],
        end=FailFast() if system.fail_fast else CoordinatorEnds(),
        replace_after=cfg.replace_after if cfg.replace_after >= 0 else None,
        # the recover system's coordinator can be restarted: it rebuilds the run from the workers
        coordinator_restarts=cfg.coordinator_restarts if system.coordinator_mode == "recover" else 0,
        coordinator_timeout=cfg.coordinator_timeout if system.coordinator_mode == "recover" else None,
        ranks_per_replica=cfg.ranks_per_replica,
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
    if status == "failed" and not ends and result.returncode == EXIT_RUN_DIR_UNWRITABLE:
        # its run_end line is among what it could not write; its log says more
        result.reason = f"the coordinator could not write the run directory {out} (exit 7; logs/coordinator.log)"
    if status == "failed" and any(getattr(e, "returncode", None) == EXIT_CHECKPOINTS_FAILED for e in result.exits):
        # a checkpoint writer stopped the run (core/launch/end_policy.py): its reason names the error
        stops = [c for c in read_jsonl(out / "checkpoints.jsonl") if c.get("stops_run")]
        if stops:
            result.reason = stops[-1]["reason"]
    done = len(read_metrics(out / "metrics.jsonl"))
    if status == "ok" and done < cfg.steps:
        status, result.reason = "failed", f"only {done} of {cfg.steps} steps committed"
    extra = dict(returncode=result.returncode, reason=result.reason, processes=[e.__dict__ for e in result.exits],
                 **{**read_finals(out), **getattr(result, "summary_extra", {})}, **_checkpoint_summary(cfg))
    wall = time.time() - t0
    try:
        return write_summary(out, status, wall, **extra)
    except OSError as e:
        summary = {"status": status, "steps": done, "wall_time": wall, **extra}
        raise RunDirUnwritable(out / "summary.json", e, summary) from None
