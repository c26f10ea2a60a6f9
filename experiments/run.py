"""Running one training job on this machine: what `recover train`, the demo, the benchmarks and the grids share.

Contract:
- `run_training(cfg, ...)` takes a validated `TrainConfig`, clears the files a run
  owns in cfg.out (`RUN_FILES`, and final/) so results never mix two runs, writes
  DIR/config.json (`resolved_config_dict`, plus the system's settings), launches
  the coordinator and one worker per replica (or the system's own supervisor for
  systems that restart or re-form their job), and writes DIR/summary.json, whose
  dict it returns. A fault plan is saved as DIR/fault_plan.json before any worker
  starts.
- Its verdict is what the processes and files say: "ok" only if the job exited 0
  and metrics.jsonl holds every one of cfg.steps steps; a failing coordinator's
  own reason (events.jsonl's run_end) beats its exit code.
- It imports nothing of the command line: commands, the demo and submitit jobs
  call it; it calls none of them.
"""
from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from recover.core.config import TrainConfig
from recover.core.end_policy import CoordinatorEnds, FailFast
from recover.core.launcher import Launcher, python_module_argv
from recover.core.results import read_finals, read_jsonl, write_summary
from recover.fault_injection.injector import launcher_hooks
from recover.fault_injection.plan import FaultPlan

from .progress import MetricsProgress
from .systems import SYSTEMS

# Files a run owns in its --out directory; a new run into the same directory
# replaces them so results never mix two runs.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "events.jsonl", "faults.jsonl",
             "fault_plan.json", "pids.json")


def resolved_config_dict(cfg: TrainConfig) -> dict:
    """DIR/config.json: the run's config, its model, its system and the environment it ran in."""
    return {
        "train": cfg.to_dict(),
        "model": asdict(cfg.gpt_config()),
        "system": {"name": cfg.system, "description": SYSTEMS[cfg.system].description},
        "environment": {"torch": importlib.metadata.version("torch"), "python": platform.python_version(),
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
        end=FailFast() if system.fail_fast else CoordinatorEnds(),
        replace_after=cfg.replace_after if cfg.replace_after >= 0 else None,
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
