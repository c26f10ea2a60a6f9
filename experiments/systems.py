"""The registry of training systems `recover train --system NAME` can run.

Contract: each `System` names the worker module the launcher starts once per
replica, the coordinator's mode, and whether one worker's failure ends the job.
`layout` names the dimensions of a replica's layout (core/config/replica_layout.py) the
system runs above 1, as core/config/layouts.py's table (the one place that says it,
and which TrainConfig.validate asks too) holds them; `check_layout(system, layout,
replicas)` refuses any other with that table's one line naming the system and the
layout, so a grid or a bench finds it before any job starts.
Baselines register here too, which is why the registry lives in experiments/
(it may import everything; core/ imports none of it).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from recover.baselines.settings import BaselineConfig
from recover.core.config.layouts import SYSTEM_LAYOUTS, refusal, runs

from recover.core.config.replica_layout import ReplicaLayout


@dataclass(frozen=True)
class System:
    """How to launch one training system."""

    name: str
    worker_module: str  # run as `python -m MODULE --config C --replica R`
    coordinator_mode: str  # "store" (rendezvous only) or "recover" (membership + commit)
    fail_fast: bool  # one worker's failure ends the job
    description: str
    # "module:function" run instead of one plain Launcher, for systems that restart
    # or re-form the job (called as function(cfg, settings, config_path, env, hooks)
    # and returning a LaunchResult); '' = the plain Launcher.
    supervisor: str = ""
    settings: type | None = None  # dataclass of the system's own settings: CLI flags, config.json "baseline"
    # How `--executor slurm` runs it (experiments/launch_submitit.py): "tasks", one task per rank
    # in one job, task 0 hosting the coordinator (recover's, a bare store, or torchft's lighthouse);
    # "requeue", the same, and a failure requeues the job, which resumes from its last complete
    # checkpoint; "agents", one torchrun agent per task (a node) around task 0's store (elastic);
    # "" not launched on Slurm yet (its supervisor starts local processes).
    on_slurm: str = "tasks"

    @property
    def layout(self) -> tuple[str, ...]:
        """ReplicaLayout dimensions it runs above 1 (() = replicas of one rank only): core/config/layouts.py."""
        return SYSTEM_LAYOUTS.get(self.name, ())

    def load_supervisor(self) -> Callable | None:
        if not self.supervisor:
            return None
        module, _, func = self.supervisor.partition(":")
        return getattr(importlib.import_module(module), func)


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System("plain", "recover.core.training.plain", "store", True,
               "plain data parallel: the failure-free reference; any fault ends the job"),
        System("recover", "recover.core.training.resilient", "recover", False,
               "ReCoVer: fault-tolerant collectives, in-step recovery, quota redistribution; M kept"),
        System("ckpt-restart", "recover.baselines.ckpt_worker", "store", True,
               "checkpoint-and-restart: DCP checkpoints every K steps; any fault restarts the whole job "
               "from the last complete one", supervisor="recover.baselines.ckpt_restart:supervise",
               settings=BaselineConfig, on_slurm="requeue"),
        System("torchft", "recover.baselines.torchft_worker", "torchft-lighthouse", False,
               "torchft (shrink in place): lighthouse quorums, Manager.allreduce; a failed step is discarded "
               "and the global batch shrinks while replicas are missing",
               supervisor="recover.baselines.torchft_run:supervise", settings=BaselineConfig),
        System("elastic", "recover.baselines.elastic_worker", "store", False,
               "elastic restart with TorchElastic (torchrun agents, c10d rendezvous, MIN:R nodes): a fault "
               "restarts every worker from the last checkpoint with the nodes left",
               supervisor="recover.baselines.elastic:supervise", settings=BaselineConfig, on_slurm="agents"),
    ]
}


def runs_layout(system: str, layout: ReplicaLayout) -> bool:
    """Whether `system` runs replicas of `layout`."""
    return runs(system, layout.shard, layout.tp, layout.pp)


def check_layout(system: str, layout: ReplicaLayout, replicas: int) -> None:
    """ConfigError, one line naming the system and the layout, unless `system` runs `replicas` x `layout`."""
    if (refused := refusal(system, replicas, layout.shard, layout.tp, layout.pp)) is not None:
        raise refused
