"""`recover bench recovery`: what a fault costs each system, measured with real kills;
`recover bench checkpoint`: DCP save / async save / load throughput (experiments/bench_checkpoint.py).

Contract: the flags are checked (a known system, at least 2 replicas so one
survives, at least one kill, M >= R) before any run starts; the measurement
itself, and what it writes, is experiments/bench.py's `bench_recovery`.
"""
from __future__ import annotations

import argparse

from recover.core.config import TrainConfig

from ..bench import bench_recovery
from ..bench_checkpoint import bench_checkpoint
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


def cmd_bench_recovery(args: argparse.Namespace) -> int:
    if args.system not in SYSTEMS:
        return fail(f"--system: unknown system {args.system!r}; choose from {', '.join(SYSTEMS)}")
    if args.replicas < 2:
        return fail("--replicas: must be >= 2 (one replica is killed, another must survive)")
    if args.kills < 1:
        return fail("--kills: must be >= 1")
    if args.microbatches < args.replicas:
        return fail("--microbatches: must be >= --replicas")
    return bench_recovery(args)


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    if args.mib < 1:
        return fail("--mib: must be >= 1")
    if args.tensors < 1:
        return fail("--tensors: must be >= 1")
    if args.repeats < 1:
        return fail("--repeats: must be >= 1")
    return bench_checkpoint(args)
