"""Each system's semantics, one small policy per system, over the loop in loop.py.

Systems are named by their labels (experiments.labels: the `recover train --system`
name plus the settings that make a variant), e.g. `elastic-keep-per-replica`.

Contract (what a failure of a working replica at time t costs; r = replicas before it,
M = microbatches per iteration, R0 = replicas at the start):

- recover: the global batch stays M. Survivors keep computing their quota until
  they learn of the failure (detect), then rebuild the communicator (rebuild); the
  microbatches in no survivor's ledger (the dead replica's, and any not yet done)
  are spread over the r-1 survivors and the iteration finishes:
      end = t + detect + rebuild + compute(M - kept, r-1) + allreduce(r-1)
  where kept = sum over survivors of min(quota_i, floor((t + detect - round_start) / t_mb)),
  plus what they kept from earlier rounds of the same iteration. Later iterations
  take iteration(r-1): fewer replicas, slower iterations, same trajectory. No
  checkpoints. A replacement is admitted at the next commit (communicator rebuild).
- ckpt-restart: every K iterations a blocking save (checkpoint_save). On a
  failure the job rolls back to the last complete checkpoint (a save in flight does
  not count) and restarts: down for restart + checkpoint_load (+ the replacement
  delay if it waits for one); it continues with the survivors, the global batch kept
  at M by more accumulation per replica. A replacement that arrives while it runs
  short-handed joins at the next restart; or right after the next checkpoint save,
  with one restart and no lost work, when running short-handed until the next
  expected failure (iteration slowdown x job MTBF) would cost more than that restart.
- elastic (TorchElastic): as ckpt-restart but a restart costs
  elastic_restart (re-rendezvous + worker restart) and never waits; a replacement's
  arrival is itself a membership change: one more rollback and restart. Two
  settings (`--elastic-batch`): `elastic-keep-global` keeps M by accumulation;
  `elastic-keep-per-replica` keeps each replica's M/R0 microbatches, so while
  replicas are missing the global batch shrinks and the iterations are off the
  failure-free trajectory.
- torchft: every replica keeps its M/R0 microbatches (the gradient is averaged over
  the participants), so the global batch shrinks while replicas are missing. The step
  in flight is discarded; the next starts after torchft_detect (heartbeat-bound) +
  torchft_quorum. No checkpoints; a replacement heals from a peer (join_seconds)
  and is admitted at the next step with a new quorum.
A checkpointing system stalls per save for the whole blocking save, or with the setting
ckpt_async (`ckpt-restart-async`) for the async save's snapshot only (Policy.save_stall).
Settings variants (labels.VARIANT_SETTINGS): the costs hold each baseline as tuned here
(BaselineConfig's 1 s last-call and 1 s torchft heartbeat timeout);
`elastic-keep-global-lastcall30s` adds the 29 s more of torch's default last-call to
every restart, `torchft-hb5s` the 4 s more of torchft's default heartbeat timeout to
every detection.
A hang adds hang_detect to the detection of every system. When the last replica dies
recover and torchft end; the checkpointing systems wait for a replacement if one is
coming.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from recover.experiments.labels import variant_label

from .failures import HANG, FailureEvents
from .loop import simulate
from .model import JobModel
from .policy_base import INF, Policy
from .record import RunRecord


BASELINE_LAST_CALL_S = 1
"""BaselineConfig.rdzv_last_call_timeout: what the costs' elastic restart was measured (or set) with."""
BASELINE_HEARTBEAT_TIMEOUT_MS = 1000
"""BaselineConfig.torchft_heartbeat_timeout_ms: what the costs' torchft detection was measured with."""
UPSTREAM_LAST_CALL_S = 30  # torch's rendezvous last-call default (documented)
UPSTREAM_HEARTBEAT_TIMEOUT_MS = 5000  # torchft's lighthouse heartbeat-timeout default (documented)


class Recover(Policy):
    """ReCoVer: in-step recovery, constant M, no rollback."""

    name = "recover"
    admits_at_commit = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sorted_members = np.arange(self.job.replicas)
        self.round_start = 0.0
        self.round_m = self.job.microbatches  # ids still to do when the round started
        self.ledger: np.ndarray | None = None  # per sorted member: ids kept from earlier rounds

    @property
    def join_delay(self) -> float:
        return self.costs.join_seconds

    def iteration_seconds(self) -> float:
        # the single coordinator's commit (last vote in -> commits out) ends every iteration
        return super().iteration_seconds() + self.costs.recover_commit_seconds

    def start_iteration(self, t: float) -> None:
        super().start_iteration(t)
        self.round_start, self.round_m, self.ledger = t, self.job.microbatches, None

    def _remove(self, replica: int) -> np.ndarray:
        keep = self.sorted_members != replica
        self.sorted_members = self.sorted_members[keep]
        self.members.discard(replica)
        return keep

    def on_failure(self, t: float, replica: int, kind: int) -> None:
        if replica in self.pending:
            self.pending.discard(replica)
            return
        c, job = self.costs, self.job
        detect = c.recover_detect_seconds + (c.hang_detect_seconds if kind == HANG else 0.0)
        if self.resume_at is not None:  # nothing in flight (startup, admission): just a new generation
            self._remove(replica)
            self.run.set_working(t, len(self.members))
            if not self.members:
                self.dead = True
                return
            self.stall(max(self.resume_at, t + detect + c.recover_rebuild_seconds))
            return
        mem = self.sorted_members
        r = len(mem)
        tmb = job.microbatch_time(r)
        base, extra = divmod(self.round_m, r)
        quota = base + (np.arange(r) < extra)
        # Survivors keep computing until they learn of the failure; a round that has not
        # started yet (a failure during the previous rebuild) has nothing to keep.
        k = int(np.floor((t + detect - self.round_start) / tmb)) if t >= self.round_start else 0
        ledger = (self.ledger if self.ledger is not None else 0) + np.minimum(quota, max(k, 0))
        keep = self._remove(replica)
        self.ledger = ledger[keep]
        self.run.set_working(t, len(self.members))
        if not self.members:
            self.dead = True
            return
        r1 = len(self.members)
        self.round_m = int(job.microbatches - self.ledger.sum())
        self.round_start = t + detect + c.recover_rebuild_seconds
        self.cur_end = (self.round_start + job.compute_seconds(self.round_m, r1) + job.allreduce_seconds(r1)
                        + c.recover_commit_seconds)

    def on_join(self, t: float, replica: int) -> None:
        self.pending.add(replica)

    def after_commit(self, t: float) -> None:
        if self.pending:  # admit replacements between iterations: one communicator rebuild
            self.members |= self.pending
            self.sorted_members = np.array(sorted(self.members))
            self.pending.clear()
            self.run.set_working(t, len(self.members))
            self.stall(t + self.costs.recover_rebuild_seconds)


class CheckpointRestart(Policy):
    """Periodic checkpoints; any failure rolls back to the last one and restarts the job."""

    name = "ckpt-restart"

    def restart_seconds(self, kind: int) -> float:
        c = self.costs
        return c.restart_seconds + (c.hang_detect_seconds if kind == HANG else 0.0) + c.checkpoint_load_seconds

    def after_commit(self, t: float) -> None:
        self.checkpoint_due(t)

    def worth_admitting(self) -> bool:
        """Restart just to take the waiting replacements in? Only if running short-handed until the
        next expected failure costs more than the restart (what an operator would weigh)."""
        r, full = len(self.members), len(self.members) + len(self.pending)
        slower = self.job.iteration_seconds(r) / self.job.iteration_seconds(full) - 1.0
        return slower * self.mtbf_seconds > self.restart_seconds(0)

    def on_resume(self, t: float) -> bool:
        if self.just_saved and self.pending and self.worth_admitting():
            # Short of replicas with replacements waiting: restart right after a save, losing nothing.
            self.members |= self.pending
            self.pending.clear()
            self.run.restarts += 1
            self.run.set_working(t, len(self.members))
            self.stall(t + self.restart_seconds(0))
            return True
        return False

    def _restart(self, t: float, kind: int, wait: float) -> None:
        self.saving = False  # a save in flight never completes: the previous checkpoint is used
        self.run.rollback(t)
        self.members |= self.pending  # replacements that arrived meanwhile come in now
        self.pending.clear()
        self.run.set_working(t, len(self.members))
        if not self.members:
            if self.replacement_delay is None:
                self.dead = True
            else:
                self.stall(INF)  # nobody left: wait for a replacement
            return
        until = t + wait + self.restart_seconds(kind)
        # A failure during the first launch relaunches it, which is never quicker than
        # the launch itself: the job still starts no earlier than it would have.
        self.stall(until if self.launched else max(until, self.resume_at))

    def on_failure(self, t: float, replica: int, kind: int) -> None:
        if replica in self.pending:
            self.pending.discard(replica)
            return
        self.members.discard(replica)
        wait = self.replacement_delay if (self.wait_for_replacement and self.replacement_delay is not None) else 0.0
        self._restart(t, kind, wait)

    def on_join(self, t: float, replica: int) -> None:
        if self.resume_at == INF:  # the job was waiting with no replica
            self.members.add(replica)
            self.run.set_working(t, len(self.members))
            self.stall(t + self.restart_seconds(0))
        elif self.resume_at is not None and not self.saving:  # a restart in progress takes it in
            self.members.add(replica)
            self.run.set_working(t, len(self.members))
        else:
            self.pending.add(replica)


class Elastic(CheckpointRestart):
    """TorchElastic: re-rendezvous and restart the workers on every membership change."""

    name = "elastic"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.shrink = self.settings.get("elastic_batch", "keep-global") == "keep-per-replica"

    def restart_seconds(self, kind: int) -> float:
        c = self.costs
        # A longer rendezvous last-call than the costs were set with adds the difference to every restart.
        last_call = self.settings.get("rdzv_last_call_timeout", BASELINE_LAST_CALL_S)
        extra = max(0.0, float(last_call - BASELINE_LAST_CALL_S))
        return (c.elastic_restart_seconds + extra + (c.hang_detect_seconds if kind == HANG else 0.0)
                + c.checkpoint_load_seconds)

    def microbatches_per_iteration(self) -> float:
        if not self.shrink:
            return float(self.job.microbatches)
        return len(self.members) * self.job.microbatches / self.job.replicas

    def on_failure(self, t: float, replica: int, kind: int) -> None:
        if replica in self.pending:
            self.pending.discard(replica)
            return
        self.members.discard(replica)
        self._restart(t, kind, 0.0)

    def on_join(self, t: float, replica: int) -> None:
        if self.resume_at is not None and not self.saving:
            super().on_join(t, replica)
            return
        # A node joining a running job: TorchElastic restarts the workers to take it in.
        self.members.add(replica)
        self._restart(t, 0, 0.0)


class Torchft(Policy):
    """torchft: per-step quorum; the step in flight is dropped; the batch shrinks while replicas are missing."""

    name = "torchft"
    admits_at_commit = True

    @property
    def join_delay(self) -> float:
        return self.costs.join_seconds

    def microbatches_per_iteration(self) -> float:
        return len(self.members) * self.job.microbatches / self.job.replicas

    def on_failure(self, t: float, replica: int, kind: int) -> None:
        if replica in self.pending:
            self.pending.discard(replica)
            return
        c = self.costs
        self.members.discard(replica)
        self.run.set_working(t, len(self.members))
        if not self.members:
            self.dead = True
            return
        # A longer heartbeat timeout than the costs were measured with delays detection by the difference.
        hb = self.settings.get("torchft_heartbeat_timeout_ms", BASELINE_HEARTBEAT_TIMEOUT_MS)
        detect = c.torchft_detect_seconds + max(0.0, (hb - BASELINE_HEARTBEAT_TIMEOUT_MS) / 1000.0)
        back = t + detect + (c.hang_detect_seconds if kind == HANG else 0.0) + c.torchft_quorum_seconds
        # The step in flight is discarded: whatever it had done is lost.
        self.stall(back if self.resume_at is None else max(self.resume_at, back))

    def on_join(self, t: float, replica: int) -> None:
        self.pending.add(replica)

    def after_commit(self, t: float) -> None:
        if self.pending:
            self.members |= self.pending
            self.pending.clear()
            self.run.set_working(t, len(self.members))
            self.stall(t + self.costs.torchft_quorum_seconds)


POLICIES: dict[str, type[Policy]] = {
    "recover": Recover,
    "ckpt-restart": CheckpointRestart,
    "elastic": Elastic,
    "torchft": Torchft,
}
"""`recover train --system` name -> the policy that simulates it."""

VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("recover", {}),
    ("ckpt-restart", {}),
    ("ckpt-restart", {"ckpt_async": True}),
    ("elastic", {"elastic_batch": "keep-global"}),
    ("elastic", {"elastic_batch": "keep-per-replica"}),
    ("torchft", {}),
    ("elastic", {"elastic_batch": "keep-global", "rdzv_last_call_timeout": UPSTREAM_LAST_CALL_S}),
    ("torchft", {"torchft_heartbeat_timeout_ms": UPSTREAM_HEARTBEAT_TIMEOUT_MS}),
)
"""Every simulated (system, settings) pair: the settings are BaselineConfig fields."""

SYSTEMS: dict[str, tuple[type[Policy], str, dict[str, Any]]] = {
    variant_label(system, settings): (POLICIES[system], system, settings) for system, settings in VARIANTS
}
"""Every simulated system, by its label (experiments.labels): label -> (policy class, system, settings)."""

CHECKPOINTING = tuple(label for label, (cls, _, _) in SYSTEMS.items() if issubclass(cls, CheckpointRestart))
"""Systems that checkpoint periodically (and so take a checkpoint interval)."""


def simulate_one(system: str, job: JobModel, costs, events: FailureEvents, horizon: float,
                 max_iterations: int | None = None, checkpoint_every: int = 0,
                 replacement_delay: float | None = None, wait_for_replacement: bool = False,
                 mtbf_seconds: float = float("inf")) -> RunRecord:
    """Simulate `system` (a SYSTEMS label) on `job` with `costs` against `events` (see loop.simulate)."""
    if system not in SYSTEMS:
        raise KeyError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    if horizon == float("inf") and max_iterations is None:
        raise ValueError("an infinite horizon needs max_iterations")
    cls, _, settings = SYSTEMS[system]
    run = RunRecord(job, system=system)
    pol = cls(job, costs, run, checkpoint_every=checkpoint_every if system in CHECKPOINTING else 0,
              max_iterations=max_iterations, replacement_delay=replacement_delay,
              wait_for_replacement=wait_for_replacement, mtbf_seconds=mtbf_seconds, settings=settings)
    return simulate(pol, events, horizon)
