"""The iteration-time model of one data-parallel training job.

Contract: `JobModel` is a pure description of the job (no state); every time it
returns is a closed-form function of its fields and of `r`, the number of replicas
that take part. The formulas (all times in seconds):

    gpus_per_replica = shard x tp x pp                    the replica's layout, one GPU per rank
    R0            = n_gpus // gpus_per_replica           replicas at the start
    t_mb(r)       = microbatch_seconds * max(1, r / cpu_slots)   (cpu_slots = 0: no sharing)
    compute(m, r) = ceil(m / r) * t_mb(r)
    allreduce(r)  = 2 (r - 1) / r * (grad_bytes / gpus_per_replica) / link_bandwidth
                    + 2 (r - 1) * link_latency                    (0 when r <= 1)
    iteration(r)  = compute(M, r) + allreduce(r)

Why each piece:
- A replica is the failure domain: the GPUs of one model copy (a node with HSDP, a
  TP x PP grid in 3D parallelism). Any of its GPUs failing takes the replica out.
- The replica's size is its layout (core/config/replica_layout.py, `ReplicaLayout`): S shard
  x TP x PP ranks, one GPU per rank, is gpus_per_replica. `JobModel.of_layout(layout,
  ...)` builds a job from one and keeps it in `layout`; a job given both checks that
  they agree (ValueError). Only the product enters the formulas below: the model
  charges a replica by its size, not by how it splits (what FSDP shards, TP slices
  and PP stages cost inside one microbatch is in microbatch_seconds). A job built
  from a bare gpus_per_replica has layout None: the size is all it says.
- compute: with equal speeds the quota policy (core/contract/policy.py) gives every replica
  floor(m/r) or ceil(m/r) microbatches, so the iteration waits for a ceil(m/r)
  replica. `microbatch_seconds` is the time one replica takes for one microbatch's
  forward and backward (all its GPUs working together).
- allreduce: a ring all-reduce moves 2 (r-1)/r of the buffer over each link and
  takes 2 (r-1) latency-bound steps. Each GPU of a replica holds 1/gpus_per_replica
  of the gradient (FSDP shard or TP x PP slice) and the gpus_per_replica rings run in
  parallel, so each ring carries grad_bytes / gpus_per_replica bytes.
- cpu_slots exists only for the local validation machine, where R worker processes
  share 2 CPU cores: with more replicas than cores each microbatch takes longer.
  cpu_slots_at replaces it with the effective slots measured at some replica counts
  (sim/validation.py's `fit_compute`: fewer than 2, and fewer with more processes, since
  the coordinator, heartbeats and gloo's threads share the cores too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from recover.core.config.fields import doc_field as _f

from recover.core.config.replica_layout import ReplicaLayout


@dataclass(frozen=True)
class JobModel:
    """One training job: its size, its global batch, and its cost per iteration."""

    n_gpus: int = _f(512, "GPUs in the job at the start")
    gpus_per_replica: int = _f(8, "GPUs per replica (one model copy, the failure domain)")
    microbatches: int = _f(1024, "microbatches M per iteration (the global batch)")
    tokens_per_microbatch: int = _f(4 * 2048, "tokens in one microbatch")
    microbatch_seconds: float = _f(0.25, "forward+backward of one microbatch on one replica")
    grad_bytes: float = _f(2.6e9, "bytes of one replica's whole gradient (all its GPUs together)")
    link_bandwidth: float = _f(25e9, "bytes/s one GPU sends on the data-parallel ring")
    link_latency: float = _f(10e-6, "seconds per ring step")
    cpu_slots: float = _f(0, "local machine only: CPU cores the replicas share (0 = no sharing; fitted, so fractional)")
    cpu_slots_at: tuple[tuple[int, float], ...] = _f(
        (), "local validation only: (replicas, effective CPU slots) measured at some replica counts, interpolated "
            "linearly between them and held beyond; overrides cpu_slots")
    # Not a calibration value (the table in summary.json leaves it out): the source of
    # gpus_per_replica says the layout in words.
    layout: ReplicaLayout | None = _f(None, "the replica's rank grid, shard x tp x pp = gpus_per_replica "
                                            "(None: only the size is known)", table=False)

    def __post_init__(self) -> None:
        if self.layout is not None:
            if not isinstance(self.layout, ReplicaLayout):
                raise ValueError(f"layout must be a ReplicaLayout, got {type(self.layout).__name__}")
            self.layout.check_size(self.gpus_per_replica)
        if self.gpus_per_replica < 1 or self.n_gpus < self.gpus_per_replica:
            raise ValueError(f"need n_gpus >= gpus_per_replica >= 1, got {self.n_gpus}, {self.gpus_per_replica}")
        if self.microbatches < self.replicas:
            raise ValueError(f"M={self.microbatches} < {self.replicas} replicas: every replica needs work")
        if self.microbatch_seconds <= 0 or self.link_bandwidth <= 0:
            raise ValueError("microbatch_seconds and link_bandwidth must be > 0")

    @classmethod
    def of_layout(cls, layout: ReplicaLayout, **fields) -> "JobModel":
        """The job whose replicas have `layout`: gpus_per_replica = shard x tp x pp."""
        if "gpus_per_replica" in fields:
            layout.check_size(fields.pop("gpus_per_replica"))
        return cls(gpus_per_replica=layout.gpus, layout=layout, **fields)

    @property
    def replicas(self) -> int:
        """R0: replicas at the start (GPUs beyond a whole replica are left idle)."""
        return self.n_gpus // self.gpus_per_replica

    @property
    def gpus_used(self) -> int:
        """GPUs that belong to a replica at the start."""
        return self.replicas * self.gpus_per_replica

    @property
    def tokens_per_iteration(self) -> int:
        """Tokens of one full (M-microbatch) iteration."""
        return self.microbatches * self.tokens_per_microbatch

    def microbatch_time(self, r: int) -> float:
        """t_mb(r): one microbatch on one replica while r replicas run."""
        slots = self.slots(r)
        if slots and r > slots:
            return self.microbatch_seconds * (r / slots)
        return self.microbatch_seconds

    def slots(self, r: int) -> float:
        """The CPU slots r replicas share: cpu_slots, or cpu_slots_at interpolated at r."""
        if not self.cpu_slots_at:
            return self.cpu_slots
        pts = sorted(self.cpu_slots_at)
        if r <= pts[0][0]:
            return pts[0][1]
        for (ra, ca), (rb, cb) in zip(pts, pts[1:]):
            if r <= rb:
                return ca + (cb - ca) * (r - ra) / (rb - ra)
        return pts[-1][1]

    def compute_seconds(self, m: float, r: int) -> float:
        """compute(m, r): m microbatches spread over r equal replicas."""
        if m <= 0:
            return 0.0
        if float(m).is_integer():
            per_replica = -(-int(m) // r)  # exact integer ceil
        else:  # a shrunk batch of fractional size per replica (M not a multiple of R0)
            per_replica = math.ceil(m / r - 1e-9)
        return per_replica * self.microbatch_time(r)

    def allreduce_seconds(self, r: int) -> float:
        """allreduce(r): ring all-reduce of the gradient over r replicas."""
        if r <= 1:
            return 0.0
        per_ring = self.grad_bytes / self.gpus_per_replica
        return 2 * (r - 1) / r * per_ring / self.link_bandwidth + 2 * (r - 1) * self.link_latency

    def iteration_seconds(self, r: int, m: float | None = None) -> float:
        """iteration(r): m (default M) microbatches over r replicas, then the all-reduce."""
        return self.compute_seconds(self.microbatches if m is None else m, r) + self.allreduce_seconds(r)

    def failure_free_throughput(self) -> float:
        """Tokens per second of the failure-free job (R0 replicas, M microbatches)."""
        return self.tokens_per_iteration / self.iteration_seconds(self.replicas)
