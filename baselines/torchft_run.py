"""torchft (shrink in place): the supervisor that runs a lighthouse and one torchft replica group per replica.

Contract:
- One launch: the coordinator process is torchft's lighthouse
  (`torchft_lighthouse.py`, with --torchft-min-replicas, --torchft-join-timeout-ms
  and --torchft-heartbeat-timeout-ms), and each replica is a torchft replica
  group: one `torchft_worker` per rank (`--shard S`, `--tp T`: S x T ranks, which the launcher
  ends together, so any rank dying takes its group out).
  Nobody is restarted: a replica that dies is gone, the others go on with fewer
  participants (torchft's own behaviour within one job; re-adding replicas is a
  scheduler's business, which this baseline leaves out).
- The job lasts while any replica does (`UntilWorkersExit`); it succeeds if a
  survivor finished every step. When every replica is gone, or the survivors fall
  below --torchft-min-replicas and time out waiting for a quorum, the run fails
  with a one-line reason and a non-zero exit.
- events.jsonl: one record per change of the participating group or discarded
  step (written by the workers, see `torchft_worker.py`).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Sequence

from recover.core.config.train_config import TrainConfig
from recover.core.launch.launcher import Launcher, LauncherHooks, python_module_argv
from recover.core.contract import env_names

from .runlog import baseline_dir
from .settings import BaselineConfig
from .supervise import SupervisedResult, UntilWorkersExit


def supervise(
    cfg: TrainConfig, settings: BaselineConfig, config_path: Path, env: dict[str, str],
    hooks: Sequence[LauncherHooks] = (),
) -> SupervisedResult:
    out = Path(cfg.out)
    shutil.rmtree(baseline_dir(out), ignore_errors=True)
    t0 = float(env[env_names.T0])
    lighthouse = python_module_argv(
        "recover.baselines.torchft_lighthouse",
        "--min-replicas", str(settings.torchft_min_replicas),
        "--join-timeout-ms", str(settings.torchft_join_timeout_ms),
        "--heartbeat-timeout-ms", str(settings.torchft_heartbeat_timeout_ms),
    )
    launcher = Launcher(
        out, lighthouse,
        lambda r: python_module_argv("recover.baselines.torchft_worker", "--config", str(config_path),
                                     "--replica", str(r)),
        cfg.replicas, env=env, hooks=hooks, end=UntilWorkersExit(), ranks_per_replica=cfg.ranks_per_replica,
    )
    result = launcher.run()
    extra: dict = {}
    final = baseline_dir(out) / "final.json"
    if final.exists():
        extra["weights_checksum"] = json.loads(final.read_text())["weights_checksum"]
    reason = result.reason
    if result.returncode == 1 and not any(e.returncode == 0 for e in result.exits if e.role == "worker"):
        reason = f"no replica left to finish the run ({reason})"
    return SupervisedResult(result.returncode, time.time() - t0, result.exits, reason, extra)
