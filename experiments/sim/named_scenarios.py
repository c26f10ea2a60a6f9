"""The named scenarios `recover simulate NAME` runs, each with what it assumes in words.

Contract: `SCENARIOS[name](seed, bench)` builds a `Scenario` (scenario_runner.py): the
local validation set-up (this machine's costs, a fault plan), paper-512 (the paper's
512 GPUs losing 256), and cluster scenarios at Llama 3's failure rate (16,384 GPUs
for 54 days, 100,000 GPUs for 30 days). `PAPER` holds the paper's published numbers
that paper-512 is compared with.

Replica layouts: each cluster scenario's replica is a `ReplicaLayout` (core/config/replica_layout.py),
shard x TP x PP ranks, one GPU per rank, whose product is the job's gpus_per_replica
(paper-512: `PAPER_512_LAYOUT`, TP 8 x PP 4 = 32; Llama 3: `LLAMA3_LAYOUT`, TP 8 x PP 16 =
128). `layout=` (`recover simulate --shard/--tp/--pp`) replaces it; the per-replica batch is
kept, so M follows the replica count. The simulator charges a replica by its size only, so
two layouts of one size give the same numbers.

What the ReCoVer paper does not state, and what paper-512 assumes instead (the
sensitivity sweep varies each): the replica size (taken as 32 GPUs, TP 8 x PP 4, so
256 lost GPUs are 8 replicas), the run length (40 minutes, so that 234 GPU-hours, the
paper's reported point, falls near the end of the run), the model and its iteration
time (about 8 s), the restart, checkpoint save and load times (calibration.py), and
the checkpoint interval (Young/Daly-optimal for the loss rate).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from recover.core.config.replica_layout import ReplicaLayout
from .calibration import LLAMA3_GPU_MTBF_HOURS, Calibration, cluster_costs, local_calibration
from .failures import FailureModel
from .measured import STATE_BYTES_PER_PARAMETER
from .model import JobModel
from .scenario_runner import Scenario

PAPER = {"effective_throughput_ratio": 2.23, "more_tokens_percent_at_gpu_hours": 74.9, "gpu_hours": 234.0,
         "source": "ReCoVer (arXiv 2605.11215), abstract: 512 GPUs, 256 lost spread across the run"}


PAPER_512_STATE_BYTES = 7e9 * STATE_BYTES_PER_PARAMETER  # the assumed 7B-class model
LLAMA3_STATE_BYTES = 405e9 * STATE_BYTES_PER_PARAMETER  # Llama 3 405B


CLUSTER_COMPARATOR = "ckpt-restart-async"
"""At cluster scale recover is compared with checkpoint-restart as a competent user sets it: saving with
dcp.async_save (the snapshot stalls training, not the write) every Young/Daly interval for that stall.
The blocking-save default (`ckpt-restart`) is simulated beside it."""


LOCAL_PLAN = (
    {"kind": "crash", "replica": 3, "step": 6, "phase": "backward"},
    {"kind": "crash", "replica": 2, "step": 13, "phase": "allreduce"},
)
"""The local default: lose half of the 4 replicas spread over a 20-step run, one of them
during the all-reduce (the same plan is given to the real runs it is compared with)."""


def local(seed: int = 0, bench: str | None = None, plan: tuple[dict, ...] | None = None,
          steps: int = 20, checkpoint_every: int = 5) -> Scenario:
    cal = local_calibration(bench)
    return Scenario(
        name="local", description="the validation set-up: 4 replicas, tiny model, M=8, this machine's costs",
        calibration=cal, failures=FailureModel("plan", plan=tuple(plan or LOCAL_PLAN), seed=seed),
        horizon_seconds=math.inf, max_iterations=steps,
        # Under TorchElastic a crashed worker is restarted by its node's agent: the group
        # re-forms at full size. The others go on without the replica.
        replacement_by_system={"elastic-keep-global": 0.0, "elastic-keep-per-replica": 0.0},
        checkpoint_every=checkpoint_every,
        assumptions={"faults": "the plan's crash faults take a replica out (recover, torchft, ckpt-restart "
                               "with the survivors); elastic restarts the crashed worker (its agent is alive)",
                     "checkpoint_every": f"{checkpoint_every} iterations (a real run's config wins in validation)"},
    )


PAPER_512_LAYOUT = ReplicaLayout(tp=8, pp=4)
"""paper-512's assumed model copy: TP 8 x PP 4 = 32 GPUs (the paper does not say)."""
PAPER_512_LOST_GPUS = 256
PAPER_512_MICROBATCHES_PER_REPLICA = 16


def paper_512_job(layout: ReplicaLayout | None = None,
                  gpus_per_replica: int | None = None) -> tuple[JobModel, dict[str, str]]:
    """paper-512's job with replicas of `layout` (default PAPER_512_LAYOUT), or of a bare size
    `gpus_per_replica` (the sensitivity sweep's loss unit: the size is all the model uses)."""
    if layout is not None and gpus_per_replica is not None:
        raise ValueError("give the replica's layout or its size, not both")
    if gpus_per_replica is None:
        layout = layout or PAPER_512_LAYOUT
        g = layout.gpus
    else:
        g = gpus_per_replica
    if not 1 <= g <= PAPER_512_LOST_GPUS:
        raise ValueError(f"paper-512 loses {PAPER_512_LOST_GPUS} of 512 GPUs in whole replicas: a replica of {g} "
                         f"GPUs must be 1 to {PAPER_512_LOST_GPUS} GPUs")
    fields = dict(n_gpus=512, microbatches=PAPER_512_MICROBATCHES_PER_REPLICA * (512 // g),
                  tokens_per_microbatch=2 * 2048, microbatch_seconds=0.5, grad_bytes=7e9 * 2,
                  link_bandwidth=25e9, link_latency=10e-6)
    job = JobModel.of_layout(layout, **fields) if layout is not None else JobModel(gpus_per_replica=g, **fields)
    lost = f"{PAPER_512_LOST_GPUS} lost GPUs = {PAPER_512_LOST_GPUS // g} replicas"
    if layout == PAPER_512_LAYOUT:
        size = (f"assumed: {layout.describe()} = {g} GPUs per model copy (the paper does not say); {lost}. "
                "See the sensitivity sweep over the loss unit")
    elif layout is not None:
        size = f"the layout given: {layout.describe()} = {g} GPUs per model copy; {lost}"
    else:
        size = f"sensitivity sweep: {g} GPUs per model copy (its layout does not change the model); {lost}"
    src = {
        "n_gpus": "the paper: 512 GPUs",
        "gpus_per_replica": size,
        "microbatches": f"assumed: {PAPER_512_MICROBATCHES_PER_REPLICA} microbatches per replica "
                        f"(pipeline-friendly), M = {job.microbatches}",
        "tokens_per_microbatch": "assumed: 2 sequences of 2,048 tokens",
        "microbatch_seconds": "assumed: 0.5 s, an ~8 s iteration (a 7B-class model); not stated by the paper",
        "grad_bytes": "assumed: 7B parameters, bf16 gradients",
        "link_bandwidth": "assumed: 200 Gb/s per GPU",
        "link_latency": "assumed: 10 us per ring step",
        "cpu_slots": "not used at cluster scale",
    }
    return job, src


def paper_512(seed: int = 0, bench: str | None = None, restart: float | None = None,
              checkpoint_every: int | str = "young-daly", gpus_per_replica: int | None = None,
              horizon: float = 2400.0, layout: ReplicaLayout | None = None) -> Scenario:
    job, src = paper_512_job(layout, gpus_per_replica)
    costs, csrc = cluster_costs(job.n_gpus, job.gpus_per_replica, bench, state_bytes=PAPER_512_STATE_BYTES)
    if restart is not None:
        costs = replace(costs, restart_seconds=restart)
        csrc["restart_seconds"] = f"sensitivity sweep: {restart} s"
    cal = Calibration("cluster-512", job, costs, {**src, **csrc})
    k = PAPER_512_LOST_GPUS // job.gpus_per_replica
    return Scenario(
        name="paper-512", description="512 GPUs, 256 of them lost evenly spread across the run, no replacement",
        calibration=cal, failures=FailureModel("spread", k_lost=k, seed=seed), horizon_seconds=horizon,
        replacement_delay=None, checkpoint_every=checkpoint_every, gpu_hour_mark=PAPER["gpu_hours"], published=PAPER,
        comparator=CLUSTER_COMPARATOR,
        assumptions={
            "losses": f"{k} replicas of {job.gpus_per_replica} GPUs lost at horizon*(i+1)/{k + 1} (the harness's "
                      "spread_losses): the paper's '256 GPUs lost spread across the run'",
            "horizon": f"{horizon:.0f} s: recover holds 512 GPUs falling to 256, about 384 on average, so it reaches "
                       "the paper's 234 GPU-hour point near the end; the paper's run length is not stated",
            "ckpt-restart": "restarts with the survivors, the batch kept at M by accumulation; "
                            "Young/Daly interval for the loss rate and each variant's stall per save; the headline "
                            f"ratio is against {CLUSTER_COMPARATOR} (async save), the blocking ckpt-restart beside it",
            "unknown": "restart time, checkpoint cost and interval, replica size: see sensitivity/",
        },
    )


LLAMA3_LAYOUT = ReplicaLayout(tp=8, pp=16)
"""Llama 3 405B's model copy at 16K GPUs: TP 8 x PP 16 = 128 GPUs (DP 128)."""


def llama3_job(n_gpus: int, layout: ReplicaLayout | None = None) -> tuple[JobModel, dict[str, str]]:
    """A Llama-3-405B-shaped job: replicas of `layout` (default TP 8 x PP 16 = 128 GPUs), 16 sequences
    of 8,192 tokens per replica."""
    layout = layout or LLAMA3_LAYOUT
    gpr = layout.gpus
    if gpr > n_gpus:
        raise ValueError(f"a replica of {layout.describe()} = {gpr} GPUs does not fit the job's {n_gpus} GPUs")
    r = n_gpus // gpr
    job = JobModel.of_layout(layout, n_gpus=n_gpus, microbatches=16 * r, tokens_per_microbatch=8192,
                             microbatch_seconds=6.2 / 16, grad_bytes=405e9 * 2, link_bandwidth=50e9,
                             link_latency=10e-6)
    if layout == LLAMA3_LAYOUT:
        size = f"Llama 3 405B's layout at 16K GPUs: {layout.describe()} = {gpr} GPUs per model copy (DP 128)"
    else:
        size = (f"the layout given: {layout.describe()} = {gpr} GPUs per model copy (Llama 3 405B's: "
                f"{LLAMA3_LAYOUT.describe()} = {LLAMA3_LAYOUT.gpus})")
    src = {
        "n_gpus": f"{n_gpus} GPUs (the scenario)",
        "gpus_per_replica": size,
        "microbatches": "Llama 3: 16 sequences per data-parallel replica (2,048 per batch at 16K GPUs, 16M tokens); "
                        "kept per replica at other sizes (weak scaling)",
        "tokens_per_microbatch": "Llama 3: 8,192-token sequences",
        "microbatch_seconds": "derived: 6 x 405e9 FLOP/token x 16.8M tokens at ~400 TFLOP/s per GPU on 16,384 GPUs "
                              "gives ~6.2 s per iteration, 16 microbatches",
        "grad_bytes": "405B parameters, bf16 gradients",
        "link_bandwidth": "assumed: 400 Gb/s per GPU",
        "link_latency": "assumed: 10 us per ring step",
        "cpu_slots": "not used at cluster scale",
    }
    return job, src


def cluster_scenario(name: str, n_gpus: int, days: float, seed: int, description: str, replacement: float = 3600.0,
                     bench: str | None = None, layout: ReplicaLayout | None = None) -> Scenario:
    job, src = llama3_job(n_gpus, layout)
    costs, csrc = cluster_costs(job.n_gpus, job.gpus_per_replica, bench, state_bytes=LLAMA3_STATE_BYTES)
    return Scenario(
        name=name, description=description, calibration=Calibration(f"cluster-{n_gpus}", job, costs, {**src, **csrc}),
        failures=FailureModel("exponential", mtbf_hours=LLAMA3_GPU_MTBF_HOURS, seed=seed),
        horizon_seconds=days * 86400.0, replacement_delay=replacement, checkpoint_every="young-daly",
        comparator=CLUSTER_COMPARATOR,
        assumptions={
            "failure rate": f"Llama 3's: 419 unexpected interruptions in 54 days on 16,384 GPUs, a per-GPU MTBF of "
                            f"{LLAMA3_GPU_MTBF_HOURS:,.0f} h, exponential (memoryless); one interruption = one "
                            "replica lost",
            "replacement": f"a failed replica is replaced after {replacement / 3600:.1f} h (assumed); recover and "
                           "torchft admit it at a step boundary, ckpt-restart at its next restart, "
                           "elastic by one more restart",
            "scaling": "weak scaling: per-replica batch fixed, so the iteration time is the same at every size "
                       "(up to the all-reduce)",
        },
    )


def llama3_16k(seed: int = 0, bench: str | None = None, layout: ReplicaLayout | None = None) -> Scenario:
    return cluster_scenario("llama3-16k", 16384, 54.0, seed, "16,384 GPUs for 54 days at Llama 3's failure rate",
                            bench=bench, layout=layout)


def cluster_100k(seed: int = 0, bench: str | None = None, layout: ReplicaLayout | None = None) -> Scenario:
    return cluster_scenario("100k", 100_000, 30.0, seed, "100,000 GPUs for 30 days at Llama 3's per-GPU failure rate",
                            bench=bench, layout=layout)


LAYOUT_SCENARIOS = ("paper-512", "llama3-16k", "100k")
"""The scenarios that take `layout=`; local's costs were measured on replicas of one process."""

SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "local": local,
    "paper-512": paper_512,
    "llama3-16k": llama3_16k,
    "100k": cluster_100k,
}
