"""`recover simulate SCENARIO --out DIR`: the calibrated simulator from the command line.

Contract:
- SCENARIO is one of the named scenarios (local, paper-512, llama3-16k, 100k), which
  write DIR/summary.json and DIR/timeseries.csv; or a sweep (scale, sensitivity), which
  writes CSVs for paper_figs/; or `validate`, which compares real runs found under
  --real (default results/) with their simulation and writes DIR/validation.json.
- DIR defaults to results/sim/SCENARIO (validate: results/sim).
- Every flag is checked before anything runs; a bad one ends the command with one
  line, `recover: error: --flag: why`, and exit code 2 (the CLI's contract).
- The cluster scenarios (paper-512, llama3-16k, 100k) take the replica's layout,
  `--shard S --tp T --pp P` (core/config/replica_layout.py): S x T x P GPUs per replica, one
  per rank, replacing the scenario's own (paper-512: TP 8 x PP 4; Llama 3: TP 8 x
  PP 16). Dimensions not given are 1. Only the product reaches the simulator's
  model, so two layouts of one size give the same numbers; the summary's source of
  gpus_per_replica names the layout. The local scenario, the sweeps and validate
  refuse the flags (local's costs were measured on replicas of one process).
- The simulator's own run time is printed and recorded (summary.json's
  simulation_runtime_seconds): the 100k scenario's is a benchmark figure, not a test.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import fail

SWEEPS = ("scale", "sensitivity", "validate")


def add_parser(sub) -> None:
    from recover.experiments.sim.system_policies import SYSTEMS
    from recover.experiments.sim.named_scenarios import SCENARIOS

    names = [*SCENARIOS, *SWEEPS]
    p = sub.add_parser(
        "simulate", help="simulate a training job at cluster scale (discrete-event, calibrated)",
        description="Simulate " + ", ".join(SYSTEMS) + " on one job against the same failures. Scenarios: "
        + ", ".join(SCENARIOS) + "; sweeps: scale, sensitivity; validate compares real runs with their simulation.",
    )
    p.add_argument("scenario", metavar="SCENARIO", help=f"one of: {', '.join(names)}")
    p.add_argument("--out", default="", help="output directory (default: results/sim/SCENARIO; validate: results/sim)")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure samplers (default: 0)")
    p.add_argument("--seeds", type=int, default=1, help="scale: seeds per cluster size (default: 1)")
    p.add_argument("--systems", default="", help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--bench", default="results/bench",
                   help="where `recover bench` wrote its results (local calibration; default: results/bench)")
    p.add_argument("--plan", default="", help="local: simulate this fault plan JSON instead of the default one")
    p.add_argument("--steps", type=int, default=20, help="local: iterations to run (default: 20)")
    lay = p.add_argument_group("replica layout (paper-512, llama3-16k, 100k; default: the scenario's)")
    lay.add_argument("--shard", type=int, default=None, help="FSDP shard ranks S per replica (default: 1 when a "
                     "layout is given)")
    lay.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks per replica (default: 1 when a "
                     "layout is given)")
    lay.add_argument("--pp", type=int, default=None, help="pipeline stages per replica (default: 1 when a layout "
                     "is given)")
    p.add_argument("--real", nargs="*", default=None,
                   help="validate: run directories, or folders to search for them (default: results/ and "
                   "results/sim/real)")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from recover.experiments.sim import named_scenarios, report, scenario_runner, sweeps
    from recover.experiments.sim.system_policies import SYSTEMS

    names = [*named_scenarios.SCENARIOS, *SWEEPS]
    if args.scenario not in names:
        return fail(f"SCENARIO: unknown scenario {args.scenario!r}; choose from {', '.join(names)}")
    if args.seed < 0:
        return fail(f"--seed: must be >= 0, got {args.seed}")
    if args.seeds < 1:
        return fail(f"--seeds: must be >= 1, got {args.seeds}")
    if args.steps < 1:
        return fail(f"--steps: must be >= 1, got {args.steps}")
    systems = tuple(s for s in args.systems.split(",") if s) if args.systems else tuple(SYSTEMS)
    for s in systems:
        if s not in SYSTEMS:
            return fail(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    plan = None
    if args.plan:
        if args.scenario != "local":
            return fail("--plan: only the local scenario takes a plan")
        if not Path(args.plan).is_file():
            return fail(f"--plan: file not found: {args.plan}")
        try:
            plan = tuple(json.loads(Path(args.plan).read_text())["faults"])
        except (ValueError, KeyError, TypeError) as e:
            return fail(f"--plan: not a fault plan ({e})")
    if args.real is not None and args.scenario != "validate":
        return fail("--real: only validate takes real runs")
    layout = None
    given = {d: getattr(args, d) for d in ("shard", "tp", "pp") if getattr(args, d) is not None}
    if given:
        from recover.core.config.replica_layout import ReplicaLayout

        if args.scenario not in named_scenarios.LAYOUT_SCENARIOS:
            return fail(f"--{next(iter(given))}: only {', '.join(named_scenarios.LAYOUT_SCENARIOS)} take a replica layout "
                        "(local's costs were measured on replicas of one process)")
        for d, v in given.items():
            if v < 1:
                return fail(f"--{d}: must be >= 1, got {v}")
        layout = ReplicaLayout(**given)
    out = Path(args.out or ("results/sim" if args.scenario == "validate" else f"results/sim/{args.scenario}"))

    t0 = time.perf_counter()
    if args.scenario == "validate":
        return _validate(args, out)
    if args.scenario == "scale":
        rows = sweeps.scale_sweep(args.seed, seeds=args.seeds)
        report.write_rows(rows, out / "scale.csv")
        print(f"scale sweep: {len(rows)} rows in {time.perf_counter() - t0:.1f}s -> {out / 'scale.csv'}")
        return 0
    if args.scenario == "sensitivity":
        res = sweeps.sensitivity(args.seed)
        report.write_rows(res["restart_x_interval"], out / "restart_x_interval.csv")
        report.write_rows(res["loss_unit"], out / "loss_unit.csv")
        report.write_rows(res["restart_x_save"], out / "restart_x_save.csv")
        (out / "paper_range.json").write_text(json.dumps(res["paper_range"], indent=2) + "\n")
        (out / "restart_matching_paper.json").write_text(json.dumps(res["restart_matching_paper"], indent=2) + "\n")
        print(f"sensitivity: {len(res['restart_x_interval'])} + {len(res['loss_unit'])} + {len(res['restart_x_save'])} runs in "
              f"{time.perf_counter() - t0:.1f}s -> {out}/")
        m = res["restart_matching_paper"]
        if m.get("restart_seconds") is not None:
            print(f"  paper-512 gives the paper's {m['target']}x when a restart takes {m['restart_seconds']:.0f} s")
        return 0

    kw = {"seed": args.seed, "bench": args.bench}
    if args.scenario == "local":
        kw.update(plan=plan, steps=args.steps)
    if layout is not None:
        kw["layout"] = layout
    try:
        sc = replace(named_scenarios.SCENARIOS[args.scenario](**kw), systems=systems)
    except ValueError as e:  # a layout the scenario cannot hold
        return fail(f"--{'/--'.join(given)}: {e}")
    res = scenario_runner.run_scenario(sc)
    summary = report.write_result(res, out)
    _print_summary(summary)
    print(f"simulated in {res.runtime_seconds:.2f}s (command {time.perf_counter() - t0:.2f}s) -> "
          f"{out / 'summary.json'}, {out / 'timeseries.csv'}")
    return 0


def _print_summary(s: dict) -> None:
    print(f"{s['scenario']}: {s['description']}; {s['failures_drawn']} failures drawn")
    print(f"  {'system':<24} {'goodput tok/s':>14} {'traj.-eq. tok/s':>15} {'vs failure-free':>16} "
          f"{'tokens/GPU-h':>14} {'ETTR':>6}")
    for name, d in s["systems"].items():
        print(f"  {name:<24} {d['goodput_tokens_per_s']:14.4g} {d['effective_throughput_tokens_per_s']:15.4g} "
              f"{d['effective_throughput_vs_failure_free']:16.3f} {d['effective_tokens_per_gpu_hour']:14.4g} "
              f"{d['ettr']:6.3f}")
    r = s.get("ratio_recover_over_ckpt_restart") or {}
    if r.get("effective_throughput") is not None:
        line = (f"  recover / {s.get('comparator', 'ckpt-restart')} trajectory-equivalent throughput: "
                f"{r['effective_throughput']:.2f}x, "
                f"goodput {r['goodput']:.2f}x")
        if r.get("effective_throughput_last_quarter"):
            line += f" (last quarter {r['effective_throughput_last_quarter']:.2f}x)"
        if r.get("more_tokens_percent_at_gpu_hour_mark") is not None:
            line += f"; {r['more_tokens_percent_at_gpu_hour_mark']:.1f}% more tokens at {r['gpu_hour_mark']:g} GPU-hours"
        print(line)
    for name, other in (s.get("ratio_recover_over") or {}).items():
        if name != s.get("comparator") and other.get("effective_throughput") is not None:
            print(f"  recover / {name}: {other['effective_throughput']:.2f}x")
    if s.get("paper"):
        p = s["paper"]
        print(f"  paper: {p['effective_throughput_ratio']}x, {p['more_tokens_percent_at_gpu_hours']}% more tokens "
              f"at {p['gpu_hours']:g} GPU-hours")


def _validate(args: argparse.Namespace, out: Path) -> int:
    from recover.experiments.sim.validation import compare, find_runs

    # by default: every run under results/ (not the simulator's own outputs), and the real runs
    # committed beside the simulator for its validation (results/sim/real)
    roots = args.real if args.real else ["results"] + (["results/sim/real"] if Path("results/sim/real").is_dir() else [])
    runs: list[Path] = []
    for r in roots:
        if not Path(r).exists():
            return fail(f"--real: not found: {r}")
        runs += find_runs(r)
    if not runs:
        print(f"no real runs (config.json + metrics.jsonl + summary.json) under {', '.join(roots)}: nothing to "
              "validate yet", file=sys.stderr)
        return 1
    result = compare(runs, args.bench)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    for row in result["runs"]:
        e, e0 = row["error_after_first_step"], row["error_from_start"]
        verdict = ("  (timing reference)" if row["role"] != "validated" else
                   "" if row["within_tolerance"] else f"  (outside {100 * result['tolerance']:.0f}%)")
        print(f"  {row['simulated_as']:<20} {row['run']}: error {'n/a' if e is None else f'{100 * e:+.1f}%'}"
              f" (from the start {'n/a' if e0 is None else f'{100 * e0:+.1f}%'}){verdict}")
    for row in result.get("not_simulated", []):
        print(f"  not simulated        {row['run']}: shard {row['shard']}, {row['reason']}")
    for name, d in result["pooled_by_system"].items():
        e = d["error"]
        print(f"  pooled {name:<13} {d['runs']} runs: error {'n/a' if e is None else f'{100 * e:+.1f}%'}")
    print(f"{result['validated']}/{result['total']} runs within {100 * result['tolerance']:.0f}% after the first step, "
          f"{result['validated_from_start']}/{result['total']} from the start -> {out / 'validation.json'}")
    return 0
