"""The per-event costs every simulated system pays: one dataclass, read by the policies and the loop.

Contract: `Costs` holds, in seconds, what each system pays per event (detection, rebuild,
restart, checkpoint save and load, joins, the coordinator's commit); `save_stall_seconds`
says how long training stalls per checkpoint, for a blocking save or an async one. Where each value comes from is
calibration.py's business (it builds Costs with a source per field); this module imports
nothing of the simulator, so the policies (policy_base.py, system_policies.py) and the loop depend
on it and not on the calibration, which runs the policies.
"""
from __future__ import annotations

from dataclasses import dataclass

from recover.core.config.fields import doc_field as _f


@dataclass(frozen=True)
class Costs:
    """What each system pays per event, in seconds."""

    startup_seconds: float = _f(0.0, "launch before the first iteration (all systems, counted in wall time)")
    recover_detect_seconds: float = _f(0.04, "recover: a crash to every survivor knowing of it")
    recover_rebuild_seconds: float = _f(0.002, "recover: survivors build the next generation's communicator")
    hang_detect_seconds: float = _f(3.0, "extra detection of a hang (frozen, not dead): only a deadline catches it")
    restart_seconds: float = _f(60.0, "ckpt-restart: fault to job running again (detect, tear down, relaunch), without the load")
    checkpoint_save_seconds: float = _f(10.0, "blocking checkpoint save, dcp.save (training stalls)")
    checkpoint_load_seconds: float = _f(20.0, "checkpoint load after a restart")
    checkpoint_async_stall_seconds: float | None = _f(None, "async save (dcp.async_save, a baseline's ckpt_async): "
                                                           "training stalls only for the snapshot, this long; None: "
                                                           "not measured, an async save stalls as a blocking one")
    elastic_restart_seconds: float = _f(90.0, "elastic: fault to workers running again (re-rendezvous, worker restart), without the load")
    torchft_detect_seconds: float = _f(5.0, "torchft: a crash to the survivors' next quorum (heartbeat-bound)")
    torchft_quorum_seconds: float = _f(0.5, "torchft: forming the new quorum / reconfiguring the process group")
    join_seconds: float = _f(10.0, "a replacement's launch and state transfer before it can join in place (recover, torchft)")
    recover_commit_seconds: float = _f(0.0, "recover: the coordinator's work per commit (last vote in -> commits "
                                            "out), on every iteration's critical path")


def save_stall_seconds(costs: Costs, asynchronous: bool = False) -> float:
    """How long training stalls per checkpoint: the whole blocking save, or (`asynchronous`, the
    baseline's ckpt_async) an async save's snapshot. The async save's background write is taken as
    complete at the end of the stall: a failure during the write would really fall back one more
    checkpoint, so this favours the baseline."""
    a = costs.checkpoint_async_stall_seconds
    return a if asynchronous and a is not None else costs.checkpoint_save_seconds
