"""`recover bench recovery`: what a fault costs each system, measured with real kills;
`recover bench checkpoint`: DCP save / async save / load throughput (experiments/bench_checkpoint.py);
`recover bench dtype`: iteration time, fp32 vs bf16 autocast (experiments/bench_dtype.py);
`recover bench digest`: the votes' weights digest against an iteration (experiments/bench_digest.py);
`recover bench coordinator`: the coordinator state machine's cost against R (experiments/bench_coordinator.py);
`recover bench transfer`: live state transfer against a plain broadcast (experiments/bench_transfer.py).

Contract: the flags are checked (a known system, at least 2 replicas so one
survives, at least one kill, M >= R) before any run starts; the measurement
itself, and what it writes, is experiments/bench.py's `bench_recovery`,
experiments/bench_checkpoint.py's `bench_checkpoint`, experiments/bench_dtype.py's `bench_dtype`,
experiments/bench_digest.py's `bench_digest` and experiments/bench_coordinator.py's `bench_coordinator`, imported when their command
runs: most import torch, which every other `recover` command (and each run's launcher
process) would otherwise pay for at start-up.
"""
from __future__ import annotations

import argparse

from recover.core.config import TrainConfig

from recover.core.shapes import MODEL_CONFIGS

from ..systems import SYSTEMS
from . import fail


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that write their figures to results/bench/",
                       description="Benchmarks measured with real processes and real faults.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    r = bsub.add_parser("recovery", help="kill replicas at random phases; measure what each kill costs",
                        description=__doc__.split("\n")[0])
    r.add_argument("--system", default="recover", help="system to measure (default: recover)")
    r.add_argument("--kills", type=int, default=21, help="kills to measure (default: 21)")
    r.add_argument("--replicas", type=int, default=4, help="replicas per run (default: 4)")
    r.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration (default: 8)")
    r.add_argument("--seed", type=int, default=0, help="seed of the kill schedule and the runs (default: 0)")
    r.add_argument("--heartbeat-timeout", type=float, default=TrainConfig.heartbeat_timeout,
                   help="heartbeat timeout of the runs (default: the config's)")
    r.add_argument("--clean-steps", type=int, default=40, help="steps of each failure-free run (default: 40)")
    r.add_argument("--repeats", type=int, default=2, help="failure-free runs per system (default: 2)")
    r.add_argument("--out", default="results/bench", help="where to write the figures (default: results/bench)")
    r.add_argument("--work", default="", help="directory for the runs themselves (default: a temp dir)")
    r.set_defaults(func=cmd_bench_recovery)
    c = bsub.add_parser("checkpoint", help="DCP save, async save and load throughput on this machine",
                        description="DCP save, async-save stall and load, one process, written to checkpoint_dcp.json.")
    c.add_argument("--mib", type=int, default=256, help="state size in MiB (default: 256)")
    c.add_argument("--tensors", type=int, default=16, help="tensors the state is split into (default: 16)")
    c.add_argument("--repeats", type=int, default=5, help="repeats of each operation (default: 5)")
    c.add_argument("--out", default="results/bench", help="where to write checkpoint_dcp.json (default: results/bench)")
    c.add_argument("--work", default="", help="directory for the checkpoints (default: a temp dir)")
    c.set_defaults(func=cmd_bench_checkpoint)
    d = bsub.add_parser("dtype", help="time per iteration, fp32 vs bf16 autocast, per model",
                        description="Iteration time of the real workload, fp32 vs bf16 autocast, interleaved in one run.")
    _workload_args(d, "dtype.json", models=["small", "gpt2-124m"], batch_size=4, microbatches=1,
                   microbatches_help="microbatches per iteration", iters=2, repeats=2)
    d.set_defaults(func=cmd_bench_dtype)
    w = bsub.add_parser("digest", help="what the votes' weights digest costs, as a share of an iteration, per model",
                        description="Iteration time and weights-digest time of the real workload, interleaved in one run.")
    _workload_args(w, "digest.json", models=["tiny", "small"], batch_size=TrainConfig.batch_size, microbatches=2,
                   microbatches_help="microbatches per iteration, M/R of a run (the tests' 8 over 4 replicas)",
                   iters=5, repeats=3)
    w.set_defaults(func=cmd_bench_digest)
    t = bsub.add_parser("transfer", help="live state transfer (a newcomer healed by a donor) against a plain "
                        "broadcast of the same bytes, per model", description="Two processes, one gloo group: "
                        "core.state_transfer against a bare broadcast, interleaved; writes state_transfer.json.")
    t.add_argument("--models", nargs="+", default=["tiny", "small"], help="models (default: tiny small)")
    t.add_argument("--repeats", type=int, default=5, help="timed rounds per model (default: 5)")
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1, as a worker)")
    t.add_argument("--out", default="results/bench", help="where to write state_transfer.json (default: results/bench)")
    t.set_defaults(func=cmd_bench_transfer)
    k = bsub.add_parser("coordinator", help="the coordinator state machine's cost per commit and per recovery, against R",
                        description="Drive core.protocol.Membership in process with R replicas; write NAME.json.")
    k.add_argument("--replicas", type=int, nargs="+", default=[64, 512, 4096, 16384],
                   help="replica counts R to measure (default: 64 512 4096 16384)")
    k.add_argument("--per-replica", type=int, default=8, help="microbatches per replica, M = this * R (default: 8)")
    k.add_argument("--repeats", type=int, default=3, help="commit and recovery rounds per R (default: 3)")
    k.add_argument("--seed", type=int, default=0, help="seed of the message order and the crashes (default: 0)")
    k.add_argument("--out", default="results/bench", help="where to write NAME.json (default: results/bench)")
    k.add_argument("--name", default="coordinator_state_machine",
                   help="file stem of the results (default: coordinator_state_machine)")
    k.add_argument("--no-gc", action="store_true",
                   help="disable Python's garbage collector while measuring (to see its share; the service runs with it)")
    k.add_argument("--no-figure", action="store_true", help="do not draw paper_figs/coordinator_scale.py's figure")
    k.set_defaults(func=cmd_bench_coordinator)


def _workload_args(p, written: str, *, models: list[str], batch_size: int, microbatches: int,
                   microbatches_help: str, iters: int, repeats: int) -> None:
    """The flags of a one-process benchmark of the real workload (dtype, digest)."""
    p.add_argument("--models", nargs="+", default=models, help=f"models (default: {' '.join(models)})")
    p.add_argument("--batch-size", type=int, default=batch_size, help=f"sequences per microbatch (default: {batch_size})")
    p.add_argument("--microbatches", type=int, default=microbatches,
                   help=f"{microbatches_help} (default: {microbatches})")
    p.add_argument("--iters", type=int, default=iters, help=f"timed iterations per round (default: {iters})")
    p.add_argument("--repeats", type=int, default=repeats, help=f"interleaved rounds (default: {repeats})")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1, as a worker)")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="bytes of the stdlib corpus (default: 1e6)")
    p.add_argument("--out", default="results/bench", help=f"where to write {written} (default: results/bench)")


def cmd_bench_recovery(args: argparse.Namespace) -> int:
    if args.system not in SYSTEMS:
        return fail(f"--system: unknown system {args.system!r}; choose from {', '.join(SYSTEMS)}")
    if args.replicas < 2:
        return fail("--replicas: must be >= 2 (one replica is killed, another must survive)")
    if args.kills < 1:
        return fail("--kills: must be >= 1")
    if args.microbatches < args.replicas:
        return fail("--microbatches: must be >= --replicas")
    from ..bench import bench_recovery

    return bench_recovery(args)


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    if args.mib < 1:
        return fail("--mib: must be >= 1")
    if args.tensors < 1:
        return fail("--tensors: must be >= 1")
    if args.repeats < 1:
        return fail("--repeats: must be >= 1")
    from ..bench_checkpoint import bench_checkpoint

    return bench_checkpoint(args)


def _bad_workload_args(args: argparse.Namespace) -> int | None:
    """fail(...) for the first bad flag of `_workload_args`, else None."""
    for m in args.models:
        if m not in MODEL_CONFIGS:
            return fail(f"--models: unknown model {m!r}; choose from {', '.join(MODEL_CONFIGS)}")
    for name in ("batch_size", "microbatches", "iters", "repeats", "threads", "corpus_bytes"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')}: must be >= 1")
    return None


def cmd_bench_dtype(args: argparse.Namespace) -> int:
    if (bad := _bad_workload_args(args)) is not None:
        return bad
    from ..bench_dtype import bench_dtype

    return bench_dtype(args)


def cmd_bench_digest(args: argparse.Namespace) -> int:
    if (bad := _bad_workload_args(args)) is not None:
        return bad
    from ..bench_digest import bench_digest

    return bench_digest(args)


def cmd_bench_coordinator(args: argparse.Namespace) -> int:
    if any(r < 2 for r in args.replicas):
        return fail("--replicas: every R must be >= 2 (one replica crashes, another must survive)")
    for name in ("per_replica", "repeats"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')}: must be >= 1")
    if not args.name or "/" in args.name:
        return fail("--name: must be a file stem (no '/')")
    from ..bench_coordinator import bench_coordinator

    return bench_coordinator(args)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    for m in args.models:
        if m not in MODEL_CONFIGS:
            return fail(f"--models: unknown model {m!r}; choose from {', '.join(MODEL_CONFIGS)}")
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            return fail(f"--{name}: must be >= 1")
    from ..bench_transfer import bench_transfer

    return bench_transfer(args)
