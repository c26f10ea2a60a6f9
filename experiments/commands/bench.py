"""`recover bench recovery`: what a fault costs each system, measured with real kills;
`recover bench checkpoint`: DCP save / async save / load throughput (experiments/benches/checkpoint.py);
`recover bench checkpoint-stall`: recover's async checkpoint stall against an iteration (experiments/benches/checkpoint_stall.py);
`recover bench dtype`: iteration time, fp32 vs bf16 autocast (experiments/benches/dtype.py);
`recover bench digest`: the votes' weights digest against an iteration (experiments/benches/digest.py);
`recover bench iteration`: failure-free iteration of recover against plain (experiments/benches/iteration.py);
`recover bench coordinator`: the coordinator state machine's cost against R (experiments/benches/coordinator_state_machine.py);
with `--service`, the real membership service against N simulated replicas over loopback
(experiments/benches/coordinator_service.py);
`recover bench transfer`: live state transfer against a plain broadcast (experiments/benches/state_transfer.py;
with --shard S, a replica of S ranks healed rank to rank, experiments/benches/sharded_transfer.py);
`recover bench coordinator-restart`: seconds from a coordinator kill to the next commit
(experiments/benches/coordinator_restart.py);
`recover bench heal`: seconds from a replica's kill to its replacement's first commit, back at
full strength with `--replace-after` (experiments/benches/heal_time.py);
`recover bench soak`: the coordinator state machine over a long run with a replacement every N
steps: steps/s, its containers, RSS and open fds (experiments/benches/soak.py);
`recover bench store-guard`: a rendezvous's store traffic through the store guard against the bare
store, against the number of clients (experiments/benches/store_guard.py).

Contract: the flags are checked (a known system, at least 2 replicas so one
survives, at least one kill, M >= R, a replica layout (`--shard`) the system
runs) before any run starts; the measurement
itself, and what it writes, is experiments/benches/recovery.py's `bench_recovery`,
experiments/benches/checkpoint.py's `bench_checkpoint`, experiments/benches/dtype.py's `bench_dtype`,
experiments/benches/digest.py's `bench_digest` and experiments/benches/coordinator_state_machine.py's `bench_coordinator`
(experiments/benches/coordinator_service.py's `bench_coordinator_service`), imported when their command
runs: most import torch, which every other `recover` command (and each run's launcher
process) would otherwise pay for at start-up.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from recover.core.config.train_config import ConfigError, TrainConfig

from recover.core.config.shapes import MODEL_CONFIGS

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
    r.add_argument("--shard", type=int, default=1,
                   help="ranks per replica S (HSDP; every system: core/config/layouts.py): a kill strikes one rank "
                        "and takes its replica; the failure-free comparison runs plain at the same layout (default: 1)")
    r.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica T (every system; default: 1)")
    r.add_argument("--pp", type=int, default=1, help="pipeline stages per replica P (recover or plain; default: 1)")
    r.add_argument("--pp-schedule", default="1f1b", help="afab or 1f1b, with --pp > 1 (default: 1f1b)")
    r.add_argument("--seed", type=int, default=0, help="seed of the kill schedule and the runs (default: 0)")
    r.add_argument("--kill-placement", choices=("random", "fixed"), default="random",
                   help="random: each kill at a uniformly drawn step of its 5-step window, anywhere in the "
                        "baselines' 5-step checkpoint period; fixed: at the window's first step, where a "
                        "checkpointing baseline loses the most (how earlier results were measured) (default: random)")
    r.add_argument("--heartbeat-timeout", type=float, default=TrainConfig.heartbeat_timeout,
                   help="heartbeat timeout of the runs (default: the config's)")
    r.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=None,
                   help="torchft only: the lighthouse's heartbeat timeout of every run (default: recover train's, 1000)")
    r.add_argument("--torchft-join-timeout-ms", type=int, default=None,
                   help="torchft only: the lighthouse's join timeout of every run (default: recover train's, 1000)")
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
    s = bsub.add_parser("checkpoint-stall", help="recover's async checkpoint: the writer's stall against an iteration",
                        description="One recover run with --checkpoint-every K per model; the stall of each save and "
                        "the iterations with and without one, written to checkpoint_stall.json.")
    s.add_argument("--models", nargs="+", default=["tiny", "small"], help="models to run (default: tiny small)")
    s.add_argument("--replicas", type=int, default=2, help="replicas (default: 2)")
    s.add_argument("--microbatches", type=int, default=4, help="microbatches M per iteration (default: 4)")
    s.add_argument("--steps", type=int, default=14, help="steps of each run (default: 14)")
    s.add_argument("--checkpoint-every", type=int, default=2, help="K (default: 2)")
    s.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1)")
    s.add_argument("--out", default="results/bench", help="where to write checkpoint_stall.json (default: results/bench)")
    s.add_argument("--work", default="", help="directory for the runs (default: a temp dir)")
    s.set_defaults(func=cmd_bench_checkpoint_stall)
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
    it = bsub.add_parser("iteration", help="failure-free iteration time of recover against plain, per model and layout",
                         description="Real recover train runs, failure-free, interleaved over rounds: recover / plain "
                                     "per model and replica layout (and against another checkout with "
                                     "--baseline-tree), written to iteration.json.")
    it.add_argument("--models", nargs="+", default=["tiny", "small"], help="models (default: tiny small)")
    it.add_argument("--layouts", nargs="+", default=["2x1"],
                    help="replica layouts RxS: R replicas of S ranks, or RxSpP: of P pipeline stages of S ranks "
                         "each (3x2, 2x2p2; default: 2x1)")
    it.add_argument("--systems", nargs="+", default=["recover", "plain"], help="systems (default: recover plain)")
    it.add_argument("--microbatches-per-replica", type=int, default=2,
                    help="M / R of every run (default: 2)")
    it.add_argument("--steps", type=int, default=12, help="steps per run; the first two are not timed (default: 12)")
    it.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    it.add_argument("--baseline-tree", default="",
                    help="a checkout of another commit to run interleaved with this one (before/after)")
    it.add_argument("--modes", nargs="+", default=["fp32"], choices=["fp32", "exact"],
                    help="accumulation modes: fp32, and/or exact (--exact: int64 fixed point, deterministic "
                         "kernels); with both, each configuration runs in both, interleaved (default: fp32)")
    it.add_argument("--profile", action="store_true",
                    help="also record each step's phases per process (relay, waits, all-reduce, digest, ...) "
                         "and write their ms per step beside the times (experiments/benches/phases.py)")
    it.add_argument("--name", default="iteration.json", help="file name under --out (default: iteration.json)")
    it.add_argument("--out", default="results/bench", help="where to write it (default: results/bench)")
    it.add_argument("--work", default="", help="directory for the runs (default: a temp dir)")
    it.set_defaults(func=cmd_bench_iteration)
    t = bsub.add_parser("transfer", help="live state transfer (a newcomer healed by a donor) against a plain "
                        "broadcast of the same bytes, per model", description="Two processes, one gloo group: "
                        "core.worker.state_transfer against a bare broadcast, interleaved; writes state_transfer.json.")
    t.add_argument("--models", nargs="+", default=["tiny", "small"], help="models (default: tiny small)")
    t.add_argument("--repeats", type=int, default=5, help="timed rounds per model (default: 5)")
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1, as a worker)")
    t.add_argument("--shard", type=int, default=1, help="S > 1: heal a replica of S FSDP2 ranks rank to rank, each "
                   "position against a plain broadcast between the same two processes, all positions at once; "
                   "writes state_transfer_s<S>.json (default: 1, the one-rank transfer)")
    t.add_argument("--out", default="results/bench", help="where to write state_transfer.json (default: results/bench)")
    t.set_defaults(func=cmd_bench_transfer)
    cr = bsub.add_parser("coordinator-restart", help="seconds from a coordinator kill (or freeze) to the next "
                         "commit, against a replica kill", description="Real recover runs with one planned fault "
                         "each (a replica crash, a coordinator crash mid-iteration and mid-commit, a coordinator "
                         "hang), interleaved; writes coordinator_restart.json.")
    cr.add_argument("--model", default="tiny", help="model of the runs (default: tiny)")
    cr.add_argument("--replicas", type=int, default=4, help="replicas per run (default: 4)")
    cr.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration (default: 8)")
    cr.add_argument("--steps", type=int, default=10, help="steps per run; the fault is at the middle one (default: 10)")
    cr.add_argument("--coordinator-timeout", type=float, default=2.0,
                    help="silence that counts as a frozen coordinator (default: 2)")
    cr.add_argument("--repeats", type=int, default=3, help="runs per scenario (default: 3)")
    cr.add_argument("--out", default="results/bench", help="where to write coordinator_restart.json")
    cr.add_argument("--work", default="", help="directory for the runs themselves (default: a temp dir)")
    cr.set_defaults(func=cmd_bench_coordinator_restart)
    h = bsub.add_parser("heal", help="seconds from a replica's kill to its replacement's first commit "
                        "(--replace-after, back at full strength)", description="Real recover runs, each with "
                        "replica 1 SIGKILLed (one rank of it) mid-run, replaced and healed from a live member; "
                        "writes heal_time.json.")
    h.add_argument("--model", default="small", help="model of the runs (default: small)")
    h.add_argument("--replicas", type=int, default=3, help="replicas per run, also --min-replicas (default: 3)")
    h.add_argument("--shard", type=int, default=2, help="ranks per replica S (default: 2)")
    h.add_argument("--rank", type=int, default=1, help="the rank of replica 1 that is killed (default: 1)")
    h.add_argument("--microbatches", type=int, default=6, help="microbatches per iteration (default: 6)")
    h.add_argument("--steps", type=int, default=12, help="steps per run; the kill is at the middle one (default: 12)")
    h.add_argument("--replace-after", type=float, default=0.2,
                   help="seconds after the loss before the replacement starts (default: 0.2)")
    h.add_argument("--heartbeat-timeout", type=float, default=2.0, help="heartbeat timeout of the runs (default: 2)")
    h.add_argument("--repeats", type=int, default=3, help="runs (default: 3)")
    h.add_argument("--out", default="results/bench/heal", help="where to write heal_time.json")
    h.add_argument("--work", default="", help="directory for the runs themselves (default: a temp dir)")
    h.set_defaults(func=cmd_bench_heal)
    k = bsub.add_parser("coordinator", help="the coordinator's cost per commit and per recovery, against R "
                        "(--service: the real service over loopback)",
                        description="Drive core.coordinator.protocol.ProtocolStateMachine in process with R replicas; write NAME.json. "
                                    "With --service: the real membership service in its own process against N "
                                    "simulated replicas (a few client processes, real connections, real faults).")
    k.add_argument("--replicas", type=int, nargs="+", default=None,
                   help="replica counts R to measure (default: 64 512 4096 16384; with --service 64 512 4096)")
    k.add_argument("--per-replica", type=int, default=8, help="microbatches per replica, M = this * R (default: 8)")
    k.add_argument("--repeats", type=int, default=3, help="commit and recovery rounds per R (default: 3)")
    k.add_argument("--seed", type=int, default=0, help="seed of the message order and the crashes (default: 0)")
    k.add_argument("--out", default="results/bench", help="where to write NAME.json (default: results/bench)")
    k.add_argument("--name", default=None,
                   help="file stem of the results (default: coordinator_state_machine; with --service coordinator_service)")
    k.add_argument("--no-gc", action="store_true",
                   help="disable Python's garbage collector altogether while measuring (to see its share; by "
                        "default it is paced as in the coordinator's process, core/coordinator/gc_pacing.py)")
    k.add_argument("--no-figure", action="store_true", help="do not draw paper_figs/coordinator_scale.py's figure")
    s_ = k.add_argument_group("--service", "the real service (experiments/benches/coordinator_service.py)")
    s_.add_argument("--service", action="store_true",
                    help="run core.coordinator.service.CoordinatorService against simulated replicas over loopback")
    s_.add_argument("--clients", type=int, default=4, help="client processes sharing the N connections (default: 4)")
    s_.add_argument("--step-seconds", type=float, default=0.5,
                    help="seconds from a quota's arrival to its vote, the compute stand-in (default: 0.5)")
    s_.add_argument("--steady-steps", type=int, default=8, help="fault-free steps measured (default: 8)")
    s_.add_argument("--crashes", type=int, default=3, help="replicas whose connection closes mid-step (default: 3)")
    s_.add_argument("--freezes", type=int, default=1, help="replicas that go silent mid-step (default: 1)")
    s_.add_argument("--heartbeat-interval", type=float, default=TrainConfig.heartbeat_interval,
                    help="the run's --heartbeat-interval (default: the config's)")
    s_.add_argument("--heartbeat-timeout", type=float, default=TrainConfig.heartbeat_timeout,
                    help="the run's --heartbeat-timeout (default: the config's)")
    s_.add_argument("--heartbeat-budget", type=float, default=TrainConfig.heartbeat_budget,
                    help="the run's --heartbeat-budget, heartbeats/s from all workers (default: the config's)")
    s_.add_argument("--collective-timeout", type=float, default=TrainConfig.collective_timeout,
                    help="the run's --collective-timeout (default: the config's)")
    s_.add_argument("--startup-timeout", type=float, default=120.0,
                    help="seconds generation 0 waits for the N hellos (default: 120)")
    s_.add_argument("--work", default="", help="directory for the runs' records (default: a temp dir)")
    k.set_defaults(func=cmd_bench_coordinator)
    so = bsub.add_parser("soak", help="the coordinator state machine over a long run, a replacement every N steps: "
                         "steps/s, container sizes, RSS and open fds", description="Drive core.coordinator.protocol.ProtocolStateMachine "
                         "in process for many steps, a member lost and a newcomer admitted every --every steps; "
                         "sample steps/s, the sizes of its containers, the process's RSS and fds; write NAME.json.")
    so.add_argument("--steps", type=int, default=100_000, help="steps of the run (default: 100000)")
    so.add_argument("--replicas", type=int, default=8, help="replicas R (default: 8)")
    so.add_argument("--per-replica", type=int, default=8, help="microbatches per replica, M = this * R (default: 8)")
    so.add_argument("--every", type=int, default=1000,
                    help="a member lost mid-step and its replacement admitted every this many steps; 0: never "
                         "(default: 1000)")
    so.add_argument("--sample-every", type=int, default=5000, help="steps between samples (default: 5000)")
    so.add_argument("--seed", type=int, default=0, help="seed of the victims and the measured speeds (default: 0)")
    so.add_argument("--launcher-starts", type=int, default=0,
                    help="also start and reap this many workers through the launcher's replacement path, "
                         "sampling its RSS and fds (0: not; default: 0)")
    so.add_argument("--out", default="results/bench", help="where to write NAME.json (default: results/bench)")
    so.add_argument("--name", default="soak", help="file stem of the results (default: soak)")
    so.set_defaults(func=cmd_bench_soak)
    sg = bsub.add_parser("store-guard", help="a rendezvous's store traffic through the store guard against the bare "
                         "store, against N clients", description="N keyed store clients each set one key and read "
                         "all N (N^2 gets), straight to the store and through core.contract.store_guard.StoreGuard; "
                         "write NAME.json.")
    sg.add_argument("--clients", type=int, nargs="+", default=[16, 64, 256],
                    help="numbers of clients N (default: 16 64 256)")
    sg.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default: 3)")
    sg.add_argument("--out", default="results/bench", help="where to write NAME.json (default: results/bench)")
    sg.add_argument("--name", default="store_guard", help="file stem of the results (default: store_guard)")
    sg.set_defaults(func=cmd_bench_store_guard)


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
    if args.shard < 1:
        return fail(f"--shard: must be >= 1, got {args.shard}")
    for flag in ("torchft_heartbeat_timeout_ms", "torchft_join_timeout_ms"):
        v, name = getattr(args, flag, None), "--" + flag.replace("_", "-")
        if v is not None and args.system != "torchft":
            return fail(f"{name}: sets torchft's lighthouse; --system is {args.system}")
        if v is not None and v < 1:
            return fail(f"{name}: must be >= 1, got {v}")
    from recover.core.config.replica_layout import ReplicaLayout
    from ..systems import check_layout

    try:
        tp, pp, schedule = getattr(args, "tp", 1), getattr(args, "pp", 1), getattr(args, "pp_schedule", "1f1b")
        check_layout(args.system, ReplicaLayout(shard=args.shard, tp=tp, pp=pp), args.replicas)
        TrainConfig(system=args.system, replicas=args.replicas, microbatches=args.microbatches,
                    shard=args.shard, tp=tp, pp=pp, pp_schedule=schedule, seed=args.seed,
                    heartbeat_timeout=args.heartbeat_timeout).validate(tuple(SYSTEMS))
    except ConfigError as e:
        return fail(str(e))
    from ..benches.recovery import bench_recovery

    return bench_recovery(args)


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    if args.mib < 1:
        return fail("--mib: must be >= 1")
    if args.tensors < 1:
        return fail("--tensors: must be >= 1")
    if args.repeats < 1:
        return fail("--repeats: must be >= 1")
    from ..benches.checkpoint import bench_checkpoint

    return bench_checkpoint(args)


def cmd_bench_checkpoint_stall(args: argparse.Namespace) -> int:
    for m in args.models:
        if m not in MODEL_CONFIGS:
            return fail(f"--models: unknown model {m!r}; choose from {', '.join(MODEL_CONFIGS)}")
    for name in ("replicas", "microbatches", "checkpoint_every", "threads"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')}: must be >= 1")
    if args.microbatches < args.replicas:
        return fail("--microbatches: must be >= --replicas")
    if args.steps < 2 + 2 * args.checkpoint_every:
        return fail("--steps: must be >= 2 + 2 * --checkpoint-every (iterations with and without a save)")
    from ..benches.checkpoint_stall import bench_checkpoint_stall

    return bench_checkpoint_stall(args)


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
    from ..benches.dtype import bench_dtype

    return bench_dtype(args)


def cmd_bench_digest(args: argparse.Namespace) -> int:
    if (bad := _bad_workload_args(args)) is not None:
        return bad
    from ..benches.digest import bench_digest

    return bench_digest(args)


def cmd_bench_iteration(args: argparse.Namespace) -> int:
    from ..benches.iteration import parse_layout

    for spec in args.layouts:
        if parse_layout(spec) is None:
            return fail(f"--layouts: {spec!r} is not RxS or RxSpP (R replicas of S ranks, e.g. 3x2; "
                        f"of P pipeline stages of S ranks, e.g. 2x2p2)")
    for system in args.systems:
        if system not in SYSTEMS:
            return fail(f"--systems: unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    if args.steps < 4 or args.repeats < 1 or args.microbatches_per_replica < 1:
        return fail("--steps must be >= 4 (two are not timed), --repeats and --microbatches-per-replica >= 1")
    if args.baseline_tree and not (Path(args.baseline_tree) / "core").is_dir():
        return fail(f"--baseline-tree: {args.baseline_tree} is not a checkout of this project (no core/)")
    from ..benches.iteration import bench_iteration

    return bench_iteration(args)


def cmd_bench_coordinator(args: argparse.Namespace) -> int:
    if args.replicas is None:
        args.replicas = [64, 512, 4096] if args.service else [64, 512, 4096, 16384]
    if args.name is None:
        args.name = "coordinator_service" if args.service else "coordinator_state_machine"
    if any(r < 2 for r in args.replicas):
        return fail("--replicas: every R must be >= 2 (one replica crashes, another must survive)")
    for name in ("per_replica", "repeats", "clients", "steady_steps"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')}: must be >= 1")
    if not args.name or "/" in args.name:
        return fail("--name: must be a file stem (no '/')")
    if args.service:
        if args.crashes < 0 or args.freezes < 0:
            return fail(f"--{'crashes' if args.crashes < 0 else 'freezes'}: must be >= 0")
        if args.crashes + args.freezes >= min(args.replicas):
            return fail("--crashes: crashes + freezes must leave a survivor at the smallest --replicas")
        try:
            TrainConfig(system="recover", heartbeat_interval=args.heartbeat_interval,
                        heartbeat_timeout=args.heartbeat_timeout, heartbeat_budget=args.heartbeat_budget,
                        collective_timeout=args.collective_timeout,
                        startup_timeout=args.startup_timeout).validate()
        except ConfigError as e:
            return fail(str(e))
        if args.step_seconds <= 0:
            return fail("--step-seconds: must be > 0")
        from ..benches.coordinator_service import bench_coordinator_service

        return bench_coordinator_service(args)
    from ..benches.coordinator_state_machine import bench_coordinator

    return bench_coordinator(args)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    for m in args.models:
        if m not in MODEL_CONFIGS:
            return fail(f"--models: unknown model {m!r}; choose from {', '.join(MODEL_CONFIGS)}")
    for name in ("repeats", "threads", "shard"):
        if getattr(args, name) < 1:
            return fail(f"--{name}: must be >= 1")
    if args.shard > 1:
        from ..benches.sharded_transfer import bench_sharded_transfer

        return bench_sharded_transfer(args)
    from ..benches.state_transfer import bench_transfer

    return bench_transfer(args)


def cmd_bench_heal(args: argparse.Namespace) -> int:
    if args.model not in MODEL_CONFIGS:
        return fail(f"--model: unknown model {args.model!r}; choose from {', '.join(MODEL_CONFIGS)}")
    if args.replicas < 2:
        return fail("--replicas: must be >= 2 (a member must live to heal the replacement)")
    if args.microbatches < args.replicas:
        return fail(f"--microbatches: must be >= --replicas ({args.replicas})")
    if not 0 <= args.rank < args.shard:
        return fail(f"--rank: must be a rank of a replica of --shard {args.shard} ranks")
    if args.steps < 4 or args.repeats < 1 or args.replace_after < 0 or args.heartbeat_timeout <= 0:
        return fail("--steps must be >= 4, --repeats >= 1, --replace-after >= 0 and --heartbeat-timeout > 0")
    from ..benches.heal_time import bench_heal

    return bench_heal(args)


def cmd_bench_coordinator_restart(args: argparse.Namespace) -> int:
    if args.model not in MODEL_CONFIGS:
        return fail(f"--model: unknown model {args.model!r}; choose from {', '.join(MODEL_CONFIGS)}")
    if args.replicas < 2:
        return fail("--replicas: must be >= 2 (a replica crash needs a survivor)")
    if args.microbatches < args.replicas:
        return fail(f"--microbatches: must be >= --replicas ({args.replicas})")
    if args.steps < 4 or args.repeats < 1 or args.coordinator_timeout <= 0:
        return fail("--steps must be >= 4, --repeats >= 1 and --coordinator-timeout > 0")
    from ..benches.coordinator_restart import bench_coordinator_restart

    return bench_coordinator_restart(args)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    if args.replicas < 2:
        return fail("--replicas: must be >= 2 (one replica is lost, another must survive)")
    for name in ("steps", "per_replica", "sample_every"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')}: must be >= 1")
    if args.every < 0 or args.launcher_starts < 0:
        return fail("--every and --launcher-starts: must be >= 0")
    if not args.name or "/" in args.name:
        return fail("--name: must be a file stem (no '/')")
    from ..benches.soak import bench_soak

    return bench_soak(args)


def cmd_bench_store_guard(args: argparse.Namespace) -> int:
    if any(n < 1 for n in args.clients) or args.repeats < 1:
        return fail("--clients and --repeats: must be >= 1")
    from ..benches.store_guard import bench_store_guard

    return bench_store_guard(args)
