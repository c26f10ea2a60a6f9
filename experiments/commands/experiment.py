"""`recover experiment NAME`: run an experiment grid (local, debug or Slurm) and aggregate it.

Contract:
- `recover experiment NAME --executor local|debug|slurm` builds and validates the
  grid of NAME (experiments.grids), prints the systems it skips and why,
  submits the runs that are not complete yet (launch_submitit), and, for the
  executors that wait (local, debug, or slurm with --wait), aggregates
  OUT/NAME/ into OUT/NAME.csv and OUT/NAME_summary.csv. It exits 1 if any run
  failed (each failure printed with its log path), 0 otherwise. `--dry-run`
  prints the grid (and, for slurm, nothing is submitted).
- `--shard S`, `--tp T` and `--pp P` (with `--pp-schedule`) give every run replicas
  of S x T x P ranks (core/config/replica_layout.py); a system that does not run that layout
  (core/config/layouts.py: torchft runs `--shard` and `--tp`, the other baselines one rank
  per replica) is refused by the grid's validation in one line naming it and the layout, before
  anything starts (keep such grids to `--systems recover`, and torchft without `--pp`; the
  failure-free reference, plain, runs them all).
- `--replace-after S` and `--min-replicas N` set those TrainConfig fields of every recover
  run (checked with the grid: a bad value is one line before anything starts). On Slurm,
  task 0 of a run's job replaces a lost replica with a job of its own
  (experiments/slurm_replacements.py).
"""
from __future__ import annotations

import argparse
import json
import time

from ..aggregate import aggregate, headline
from ..grids import EXPERIMENTS, SCALES, build_grid
from ..launch_submitit import SlurmOptions, submit_grid
from . import fail


def add_parser(sub) -> None:
    p = sub.add_parser(
        "experiment", help="run an experiment grid (local, debug or Slurm) and aggregate its results",
        description="Run the grid of experiment NAME with submitit and aggregate it into OUT/NAME.csv "
        "and OUT/NAME_summary.csv. Runs already complete are skipped.",
    )
    p.add_argument("name", choices=list(EXPERIMENTS), metavar="NAME", help=f"one of {', '.join(EXPERIMENTS)}")
    p.add_argument("--executor", choices=["local", "debug", "slurm"], default="local",
                   help="local: jobs as processes here; debug: in this process; slurm: sbatch job arrays")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the experiment's)")
    p.add_argument("--scale", choices=list(SCALES), default="local",
                   help="; ".join(f"{k}: {v.description}" for k, v in SCALES.items()))
    p.add_argument("--systems", nargs="+", default=None, metavar="LABEL",
                   help="only these system labels (e.g. recover ckpt-restart); failure-free is always kept")
    p.add_argument("--replicas", type=int, default=None, help="replicas of trajectory/throughput runs (default: the scale's)")
    p.add_argument("--steps", type=int, default=None, help="steps of every run (default: the scale's)")
    p.add_argument("--shard", type=int, default=None,
                   help="ranks per replica S (HSDP: FSDP2 shards the model over them; every system runs it; "
                        "default: the scale's, 1)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks T per replica (every system runs it; default: the scale's, 1)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages P per replica (recover and plain only, so give --systems recover; "
                        "default: the scale's, 1)")
    p.add_argument("--pp-schedule", choices=["afab", "1f1b"], default=None,
                   help="pipeline schedule of --pp runs (default: the scale's, 1f1b)")
    p.add_argument("--recovery-replicas", type=int, nargs="+", default=None,
                   help="replica counts of the recovery sweep (default: the scale's)")
    p.add_argument("--checkpoint-every", "--ckpt-every", dest="checkpoint_every", type=int, default=None,
                   help="checkpoint-restart and elastic runs: a checkpoint every K iterations (default: theirs, 5)")
    p.add_argument("--replace-after", type=float, default=None, metavar="S",
                   help="recover runs: a lost replica gets a replacement S seconds later (locally new processes; on "
                        "Slurm a one-node job that task 0 submits, started when a node is free); default: never")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="recover runs: with fewer members, the next step waits for replacements to join "
                        "(so a run with --replace-after ends at full strength; default: 1)")
    p.add_argument("--out", default="results", help="results folder (default: results)")
    p.add_argument("--logs", default="runs/experiments", help="where each run's process logs go (default: runs/experiments)")
    p.add_argument("--folder", default="", help="submitit's folder (default: runs/submitit/NAME)")
    p.add_argument("--parallel", type=int, default=1, help="local: runs at the same time (default: 1)")
    p.add_argument("--timeout-min", type=int, default=60, help="local: time limit of each run's job, minutes")
    p.add_argument("--dry-run", action="store_true", help="print the grid, launch nothing")
    s = p.add_argument_group("slurm (--executor slurm)")
    s.add_argument("--nodes", type=int, default=None,
                   help="nodes of trajectory/throughput runs: replicas = nodes x gpus per node")
    s.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (= tasks, ranks) per node (default: the scale's)")
    s.add_argument("--tasks-per-node", type=int, default=None,
                   help="ranks per node (default: the GPUs per node; a CPU-only scale puts all ranks on one node)")
    s.add_argument("--partition", default="", help="Slurm partition")
    s.add_argument("--account", default="", help="Slurm account")
    s.add_argument("--time", type=int, default=240, help="time limit of each run's job, minutes (default: 240)")
    s.add_argument("--cpus-per-task", type=int, default=8, help="CPUs per rank (default: 8)")
    s.add_argument("--mem-gb", type=float, default=0.0, help="memory per node, GB (default: the cluster's)")
    s.add_argument("--array-parallelism", type=int, default=4, help="runs of an array at the same time (default: 4)")
    s.add_argument("--setup", action="append", default=[], help="a shell line run before srun (repeatable)")
    s.add_argument("--wait", action="store_true", help="wait for the Slurm jobs, then aggregate")
    s.add_argument("--kill-on-node-failure", action="store_true",
                   help="let Slurm end a job when one of its nodes fails (default: --no-kill, the job runs on)")
    s.add_argument("--start-timeout", type=float, default=0.0,
                   help="with --wait: fail a job still pending after this many minutes (default: 0, no limit)")
    p.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:

    for flag in ("replicas", "steps", "nodes", "gpus_per_node", "tasks_per_node", "parallel", "shard", "tp", "pp",
                 "checkpoint_every"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            return fail(f"--{flag.replace('_', '-')}: must be >= 1, got {v}")
    replicas = args.replicas
    if args.nodes is not None:
        gpn = args.gpus_per_node or SCALES[args.scale].gpus_per_node
        if gpn < 1:
            return fail("--nodes: the scale is CPU-only; give --gpus-per-node too")
        sc = SCALES[args.scale]
        ranks = (args.shard or sc.shard) * (args.tp or sc.tp) * (args.pp or sc.pp)
        if (args.nodes * gpn) % ranks:
            return fail(f"--nodes: {args.nodes} x {gpn} GPUs do not split into replicas of {ranks} ranks "
                        "(--shard x --tp x --pp)")
        replicas = args.nodes * gpn // ranks
    try:
        grid = build_grid(args.name, args.seeds, args.scale, args.systems, replicas, args.steps,
                          tuple(args.recovery_replicas) if args.recovery_replicas else None, shard=args.shard,
                          tp=args.tp, pp=args.pp, pp_schedule=args.pp_schedule,
                          baseline=None if args.checkpoint_every is None else {"ckpt_every": args.checkpoint_every},
                          recover={k: v for k, v in (("replace_after", args.replace_after),
                                                     ("min_replicas", args.min_replicas)) if v is not None})
    except (KeyError, ValueError) as e:
        return fail(str(e).strip("'\""))
    for note in grid.notes:
        print(f"note: {note}")
    print(f"{args.name}: {len(grid.runs)} runs ({args.scale} scale, executor {args.executor})")
    if args.dry_run:
        for r in grid.runs:
            faults = len(r.plan["faults"]) if r.plan else 0
            print(f"  {r.name:<40} {r.system:<14} seed {r.seed} R={r.replicas} S={r.shard} T={r.tp} P={r.pp} M={r.microbatches} "
                  f"steps={r.steps} faults={faults} nodes={r.nodes}")
        return 0
    if args.scale != "local" and args.executor != "slurm":
        print(f"note: the {args.scale} scale is sized for a GPU cluster; it will be slow or fail here")
    slurm = SlurmOptions(partition=args.partition, account=args.account, time_min=args.time,
                         cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb,
                         array_parallelism=args.array_parallelism, setup=args.setup,
                         gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
                         no_kill=not args.kill_on_node_failure, start_timeout_min=args.start_timeout)
    t0 = time.time()
    outcomes = submit_grid(grid, args.executor, root=args.out, logs_root=args.logs,
                           folder=args.folder or f"runs/submitit/{args.name}", parallel=args.parallel,
                           slurm=slurm, wait=args.executor != "slurm" or args.wait, timeout_min=args.timeout_min)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    print(f"{args.name}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" in {time.time() - t0:.0f}s")
    for o in outcomes:
        if o.status == "failed":
            print(f"FAILED {o.name}: {o.detail}")
        elif o.status == "skipped" and o.detail != "already complete":
            print(f"skipped {o.name}: {o.detail}")
    if args.executor != "slurm" or args.wait:
        p1, p2, summaries = aggregate(args.out, args.name)
        print(f"aggregated -> {p1}, {p2}")
        print(json.dumps(headline(summaries), indent=1))
    return 1 if counts.get("failed") else 0
