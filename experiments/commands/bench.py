"""`recover bench recovery`: what a fault costs each system, measured with real kills.

Contract: the flags are checked (a known system, at least 2 replicas so one
survives, at least one kill, M >= R) before any run starts; the measurement
itself, and what it writes, is experiments/bench.py's `bench_recovery`.
"""
from __future__ import annotations

import argparse

from recover.core.config import TrainConfig

from ..bench import bench_recovery
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
