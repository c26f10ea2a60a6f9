"""The failure-free iteration benchmark (`recover bench iteration`): what recover costs over plain.

Contract:
- Runs real `recover train` jobs, failure-free, for every (model, layout, system)
  asked, `--repeats` rounds, interleaved (every configuration once per round, in
  turn), so a change in the machine's load touches all of them alike. A layout is
  RxS: R replicas of S ranks (S > 1: HSDP), or RxSpP: each replica P pipeline
  stages of S ranks each (2x2p2 is 2 x (PP2 x S2)). Each system runs at every layout
  it runs (core/config/layouts.py); the others are named, with why, and skipped.
- A run's iteration time is the median of the gaps between consecutive commits'
  `wall_time` in its metrics.jsonl, leaving out the first two steps (first calls,
  allocations). A configuration's figure is the median over its rounds.
- `--baseline-tree DIR`: a checkout of another commit of this project (e.g. a
  worktree of main before a change). Each of its configurations runs interleaved
  with this tree's, through a folder of links that maps `recover.*` onto DIR (put
  first on PYTHONPATH), so "before" and "after" are measured in one run. Layouts
  with S > 1 run on this tree only (the baseline may predate them).
- `--modes fp32 exact`: every configuration also runs with `--exact` (core/worker/exact.py),
  interleaved with its fp32 run; each row names its mode and its all-reduce buffer's
  bytes, and the ratios exact / fp32 (time and bytes) are added.
- `--profile`: every run also records where its steps' time goes, per process
  (experiments/benches/phases.py, installed as the run's `sitecustomize`, so a
  `--baseline-tree` is profiled alike); iteration.json then holds, per
  configuration, each role's (leader, follower) ms per step by phase, the mean
  over rounds. The wrappers cost about a microsecond a call: compare a profiled
  run's times with profiled runs only.
- Writes OUT/iteration.json: per configuration its median seconds, the runs' own
  medians, and for every system beside plain (recover, torchft, ...) its ratio over
  plain for each (model, layout, tree) in the first mode: the median of the
  per-round ratios (both runs of a round measured back to back) with their min and
  max, the spread a note quotes beside the figure (`over_plain`). Nothing here is
  asserted on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recover.core.config.layouts import refusal, runs as runs_layout
from recover.core.storage.results import read_metrics

FOLDERS = ("core", "baselines", "fault_injection", "experiments")


def _shim(tree: Path, into: Path) -> Path:
    """A folder whose recover/<folder> links point into `tree` (PYTHONPATH's first entry)."""
    pkg = into / "recover"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in FOLDERS:
        link = pkg / d
        if not link.exists():
            link.symlink_to(tree.resolve() / d)
    return into


def parse_layout(spec: str) -> tuple[int, int, int] | None:
    """A layout's (R, S, P) from "R", "RxS" or "RxSpP" (3x2: 3 replicas of 2 ranks; 2x2p2: 2 replicas of
    2 pipeline stages of 2 ranks); None if `spec` is none of these or a number is below 1."""
    m = re.fullmatch(r"(\d+)(?:x(\d+)(?:p(\d+))?)?", spec)
    if m is None:
        return None
    r, s, p = (int(g) if g else 1 for g in m.groups())
    return (r, s, p) if min(r, s, p) >= 1 else None


def layout_name(r: int, s: int, p: int) -> str:
    """The layout as --layouts spells it: "3x2", "2x2p2"."""
    return f"{r}x{s}" + (f"p{p}" if p > 1 else "")


def _iteration_seconds(metrics: Path) -> float:
    walls = [m["wall_time"] for m in read_metrics(metrics)]
    gaps = [b - a for a, b in zip(walls[2:], walls[3:])]
    if not gaps:
        raise RuntimeError(f"{metrics}: too few steps to time (need at least 4)")
    return statistics.median(gaps)


def allreduce_bytes(model: str, mode: str) -> int:
    """Bytes of one replica's all-reduce buffer: fp32 [gradient..., loss] or, with --exact, int64
    [gradient..., loss, wide count, bad count] (core/worker/exact.py; a step with a spike also reduces the
    n wide sums). A ring all-reduce sends 2(R-1)/R of it per rank."""
    from recover.core.config.shapes import model_config
    from recover.core.components.model import GPT
    import torch
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(model_config(model)).parameters() if p.requires_grad)
    return (n + 3) * 8 if mode == "exact" else (n + 1) * 4


def over_plain(system_runs: list[float], plain_runs: list[float], system: str = "recover") -> dict:
    """A system's cost over plain, with its spread: the ratio of each round's two runs (run in the
    same round, so a change in the machine's load touches both), their median, min and max.

    `over_plain` is the median of the per-round ratios, not the ratio of the medians: one slow
    round of one system then moves the spread, not the figure. For recover the same figure is
    also kept as `recover_over_plain`, the key earlier results carry."""
    per_round = [x / p for x, p in zip(system_runs, plain_runs)]
    out = {"over_plain": statistics.median(per_round), "over_plain_min": min(per_round),
           "over_plain_max": max(per_round), "per_round": per_round}
    if system == "recover":
        out["recover_over_plain"] = out["over_plain"]
    return out


def _run(work: Path, name: str, system: str, model: str, replicas: int, shard: int, steps: int,
         microbatches: int, pythonpath: str | None, mode: str = "fp32", profile: dict | None = None,
         pp: int = 1) -> float:
    out = work / name
    if profile is not None:  # the phases of every process of the run (experiments/benches/phases.py)
        from recover.core.contract import env_names
        from recover.experiments.benches import phases
        site, found = work / f"{name}-site", work / f"{name}-phases"
        site.mkdir(parents=True, exist_ok=True)
        found.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(phases.site_source(found, env_names.REPLICA, env_names.LOCAL_RANK))
        pythonpath = str(site) + (os.pathsep + pythonpath if pythonpath else "")
    argv = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", system, "--model", model,
            "--replicas", str(replicas), "--microbatches", str(microbatches), "--steps", str(steps),
            "--out", str(out), "--no-progress"] + (["--exact"] if mode == "exact" else [])
    if shard > 1:
        argv += ["--shard", str(shard)]
    if pp > 1:
        argv += ["--pp", str(pp)]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    if profile is not None:
        profile.update(phases.summarize(found))
    return _iteration_seconds(out / "metrics.jsonl")


def _mean_profile(rounds: list[dict]) -> dict:
    """Each role's phases, ms per step, the mean over the rounds that have it."""
    out: dict = {}
    for role in sorted({r for p in rounds for r in p}):
        have = [p[role] for p in rounds if role in p]
        names = {n for p in have for n in p}
        out[role] = dict(sorted(((n, statistics.mean(p.get(n, 0.0) for p in have)) for n in names),
                                key=lambda kv: -kv[1]))
    return out


def bench_iteration(args: argparse.Namespace) -> int:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="recover-bench-iteration-"))
    work.mkdir(parents=True, exist_ok=True)
    trees: dict[str, str | None] = {"this": None}
    if args.baseline_tree:
        trees = {"baseline": str(_shim(Path(args.baseline_tree), work / "baseline-shim")), "this": None}
    layouts = [parse_layout(spec) for spec in args.layouts]
    modes = getattr(args, "modes", None) or ["fp32"]
    configs = [(model, r, s, p, tree, system, mode) for model in args.models for (r, s, p) in layouts
               for tree in trees for system in args.systems for mode in modes
               if not (p > 1 and tree != "this") and not (mode == "exact" and (s > 1 or p > 1))
               and runs_layout(system, shard=s, pp=p)]
    for system in args.systems:  # each system at every layout it runs; said once for the others
        for r, s, p in layouts:
            if (refused := refusal(system, r, s, pp=p)) is not None:
                print(f"{system} at {layout_name(r, s, p)}: not measured ({refused.message})", flush=True)
    runs: dict[tuple, list[float]] = {c: [] for c in configs}
    profiles: dict[tuple, list[dict]] = {c: [] for c in configs}
    for k in range(args.repeats):
        for c in configs:
            model, r, s, p, tree, system, mode = c
            name = f"{model}-{layout_name(r, s, p)}-{tree}-{system}-{mode}-{k}"
            prof = {} if getattr(args, "profile", False) else None
            runs[c].append(_run(work, name, system, model, r, s, args.steps, args.microbatches_per_replica * r,
                                trees[tree], mode, prof, pp=p))
            if prof is not None:
                profiles[c].append(prof)
            print(f"round {k + 1}/{args.repeats} {name}: {1000 * runs[c][-1]:.1f} ms per iteration", flush=True)
    rows = [{"model": m, "layout": layout_name(r, s, p), "tree": tree, "system": system, "mode": mode,
             "iteration_s": statistics.median(v), "runs_s": v,
             "allreduce_bytes": allreduce_bytes(m, mode)}
            for (m, r, s, p, tree, system, mode), v in runs.items()]
    ratios = []
    if len(modes) > 1:
        for row in rows:
            if row["mode"] != "exact":
                continue
            base = next(x for x in rows if x["mode"] == "fp32" and all(
                x[k] == row[k] for k in ("model", "layout", "tree", "system")))
            ratios.append({"model": row["model"], "layout": row["layout"], "tree": row["tree"],
                           "system": row["system"], "exact_over_fp32": row["iteration_s"] / base["iteration_s"],
                           "bytes_exact_over_fp32": row["allreduce_bytes"] / base["allreduce_bytes"]})
    for m in args.models:
        for r, s, p in layouts:
            for tree in trees:
                by = {row["system"]: row["runs_s"] for row in rows if (row["model"], row["layout"], row["tree"],
                                                                       row["mode"]) == (m, layout_name(r, s, p), tree, modes[0])}
                for system, runs_s in by.items():
                    if system != "plain" and "plain" in by:
                        ratios.append({"model": m, "layout": layout_name(r, s, p), "tree": tree, "system": system,
                                       **over_plain(runs_s, by["plain"], system)})
    result = {"bench": "iteration", "command": " ".join(sys.argv), "machine": platform.platform(),
              "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "baseline_tree": args.baseline_tree or None, "steps": args.steps, "repeats": args.repeats,
              "rows": rows, "ratios": ratios}
    if getattr(args, "profile", False):
        result["profile"] = [{"model": m, "layout": layout_name(r, s, p), "tree": tree, "system": system,
                              "mode": mode, "ms_per_step": _mean_profile(profiles[(m, r, s, p, tree, system, mode)])}
                             for (m, r, s, p, tree, system, mode) in configs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps(result, indent=1))
    for x in ratios:
        if "exact_over_fp32" in x:
            print(f"{x['model']:6s} {x['layout']:5s} {x['system']:8s} exact/fp32 = {x['exact_over_fp32']:.3f} "
                  f"(all-reduce bytes x{x['bytes_exact_over_fp32']:.2f})")
        else:
            print(f"{x['model']:6s} {x['layout']:5s} {x['tree']:8s} {x['system']}/plain = {x['over_plain']:.3f} "
                  f"(rounds: {x['over_plain_min']:.3f}-{x['over_plain_max']:.3f}, n={len(x['per_round'])})")
    for p in result.get("profile", []):
        for role, phases_ms in p["ms_per_step"].items():
            print(f"{p['model']} {p['layout']} {p['tree']} {role}: " + ", ".join(
                f"{n} {v:.1f}" for n, v in phases_ms.items() if v >= 0.05) + " (ms per step)")
    print(f"-> {out / args.name}")
    return 0
