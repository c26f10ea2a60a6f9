"""Checkpoint-and-restart: the supervisor that tears a job down on any fault and restarts it.

Contract:
- `supervise` runs the job as a sequence of attempts. Each attempt is a plain
  `core.launch.launcher.Launcher` (a store coordinator and one `ckpt_worker` per member
  replica) run fail-fast: the first worker that exits non-zero ends the attempt,
  and the launcher kills every other process of it, as a cluster scheduler
  would cancel the whole job.
- A replica of many ranks (`--shard S`, `--tp T`) is that many processes of every
  attempt, started and ended together; any of them failing ends the attempt, and
  the replica is the culprit (the replica is the failure domain).
- After a failed attempt the next one starts from the last *complete* DCP
  checkpoint (a save killed midway is never loaded: `core/training/checkpoint.py`), either
  - with the survivors only (--restart-mode survivors): the culprit replicas are
    dropped and the others keep the global batch M by accumulating more, or
  - with a replacement (--restart-mode replace): after --replace-after seconds the
    job restarts at full size, the newcomer taking the lost replica's id.
- What the supervisor saw (the fault, detected_at, the culprits, the mode) is left
  in DIR/baseline/fault-<attempt>.json for the next attempt's rank 0, which writes
  the restart record to events.jsonl at its first commit: detected_at,
  relaunched_at, started_at, resumed_at, restart_seconds (detected -> resumed),
  from_step, furthest_step (the step in flight when the fault hit), step (the
  first step committed again), work_lost_steps and work_lost_microbatches (work
  done since the checkpoint, committed or not). All times
  are seconds since the run started, like metrics.jsonl's wall_time.
- The run gives up, with a one-line reason and a non-zero exit, when no replica
  is left (survivors mode) or after --max-restarts restarts; the reason is also
  an "abort" record in events.jsonl.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Sequence

from recover.core.config.train_config import TrainConfig
from recover.core.launch.end_policy import FailFast
from recover.core.launch.launcher import LauncherHooks, Launcher, python_module_argv
from recover.core.storage.results import JsonlWriter
from recover.core.contract import env_names
from recover.core.launch.coordinator_command import MODULE as COORDINATOR, coordinator_args

from .runlog import baseline_dir, fault_notice_path
from .settings import BaselineConfig
from .supervise import FirstFailure, SupervisedResult

WORKER = "recover.baselines.ckpt_worker"


def _final_extra(out: Path, restarts: int) -> dict:
    final = baseline_dir(out) / "final.json"
    extra = {"restarts": restarts}
    if final.exists():
        extra["weights_checksum"] = json.loads(final.read_text())["weights_checksum"]
    return extra


def _abort(out: Path, reason: str, detected_at: float | None) -> None:
    events = JsonlWriter(out / "events.jsonl")
    events.write({"kind": "abort", "reason": reason, "detected_at": detected_at})
    events.close()


def supervise(
    cfg: TrainConfig, settings: BaselineConfig, config_path: Path, env: dict[str, str],
    hooks: Sequence[LauncherHooks] = (),
) -> SupervisedResult:
    out = Path(cfg.out)
    shutil.rmtree(baseline_dir(out), ignore_errors=True)  # never resume another run's checkpoints
    t0 = float(env[env_names.T0])
    members = list(range(cfg.replicas))
    exits = []
    attempt = restarts = 0
    while True:
        watch = FirstFailure(t0)
        attempt_start = time.time() - t0
        launcher = Launcher(
            out,
            python_module_argv(COORDINATOR, *coordinator_args(config_path, "store")),
            lambda r: python_module_argv(WORKER, "--config", str(config_path), "--replica", str(r)),
            members,
            env={**env, env_names.MEMBERS: ",".join(map(str, members)), env_names.ATTEMPT: str(attempt)},
            hooks=[*hooks, watch],
            end=FailFast(),
            ranks_per_replica=cfg.ranks_per_replica,  # a replica of many ranks: started and ended together
        )
        result = launcher.run()
        for e in result.exits:  # the launcher counts from its own start; the run from t0
            e.at += attempt_start
        exits.extend(result.exits)
        wall = time.time() - t0
        if result.returncode in (0, 130):  # done, or interrupted by the user
            return SupervisedResult(result.returncode, wall, exits, result.reason, _final_extra(out, restarts))
        restarts += 1
        if restarts > settings.max_restarts:
            reason = f"gave up after {settings.max_restarts} restarts (last fault: {result.reason})"
            _abort(out, reason, watch.detected_at)
            return SupervisedResult(1, wall, exits, reason, _final_extra(out, restarts - 1))
        culprits = watch.culprits
        if settings.restart_mode == "survivors":
            members = [m for m in members if m not in culprits]
            if not members:
                reason = f"no replica left to restart with (last fault: {result.reason})"
                _abort(out, reason, watch.detected_at)
                return SupervisedResult(1, wall, exits, reason, _final_extra(out, restarts - 1))
        elif culprits and settings.replace_wait > 0:
            time.sleep(settings.replace_wait)  # a replacement node takes this long to arrive
        attempt += 1
        notice = {
            "fault": result.reason, "failed_replicas": culprits, "detected_at": watch.detected_at,
            "restart_mode": settings.restart_mode, "relaunched_at": time.time() - t0,
        }
        path = fault_notice_path(cfg.out, attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(notice))
