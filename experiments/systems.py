"""The registry of training systems `recover train --system NAME` can run.

Contract: each `System` names the worker module the launcher starts once per
replica, the coordinator's mode, and whether one worker's failure ends the job.
Baselines register here too, which is why the registry lives in experiments/
(it may import everything; core/ imports none of it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    """How to launch one training system."""

    name: str
    worker_module: str  # run as `python -m MODULE --config C --replica R`
    coordinator_mode: str  # "store" (rendezvous only) or "recover" (membership + commit)
    fail_fast: bool  # one worker's failure ends the job
    description: str


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System("plain", "recover.core.plain", "store", True,
               "plain data parallel: the failure-free reference; any fault ends the job"),
        System("recover", "recover.core.resilient", "recover", False,
               "ReCoVer: fault-tolerant collectives, in-step recovery, quota redistribution; M kept"),
    ]
}
