"""Aggregation: an experiment's run directories in, two tidy CSV files out.

Contract (ROOT = the results folder, EXP = the experiment):
- Reads only the results contract of every run under ROOT/EXP/*/ (config.json,
  metrics.jsonl, summary.json, faults.jsonl, events.jsonl, and spec.json when the
  run came from a grid; without it the label, seed and failure-free reference are
  inferred from config.json: system "plain" is the failure-free run of its seed).
- Writes ROOT/EXP.csv: one row per (run, committed step): system label, seed,
  replicas and the replica's layout (`shard`, `tp`, `pp`: core/config/replica_layout.py, each
  1 for runs that predate it), loss, the failure-free run's loss at that step and the difference, tokens,
  wall time, members, whether the step is on the failure-free trajectory, and the
  running totals of effective tokens and process-seconds.
- Writes ROOT/EXP_summary.csv: one row per run: final loss and its difference
  from failure-free, the largest per-step difference, goodput and effective
  (trajectory-equivalent) throughput per wall second and per process-hour, and
  per second from the first commit on with the start-up it leaves out (the
  first commit's wall time), the weights checksum where the system
  records one, and for a run with faults the time from its first fault to the
  next committed iteration.
- Definitions (stated once, here):
  * a step is ON the failure-free trajectory when the failure-free run of the same
    seed committed the same step, with exactly the same ids (`step_id_ranges`), and the
    run's loss is within REL_TOL (relative) of the failure-free loss;
  * effective tokens = tokens of the committed steps on the trajectory;
    the two throughput metrics (experiments/throughput.py defines both, for every
    reader): goodput = all committed tokens, and trajectory-equivalent ("effective")
    throughput = effective tokens, each / the run's training time (the wall_time of
    its last commit) and / its process-hours;
  * process-seconds = the integral, from the start to the last commit, of the
    processes the job holds: S x T x P ranks per replica times R minus the replicas lost so far (faults of a kind that
    takes a replica out, by their wall_time in faults.jsonl: no replacement, as in
    the paper), but never fewer than the members of the next commit (a system that
    brought a replica back is charged for it). This is the paper's GPU-hours, with
    one process (rank) per GPU, and it charges a restarting system for the replicas it
    holds while it restarts;
  * faults_fired = faults fired by the time the step committed; faults_at_step =
    faults that struck during that step (faults.jsonl's step);
  * recovery time = the wall_time of the first commit after a fault fired minus
    the fault's wall_time (faults.jsonl): detection + rebuild + the redone work.
- Final parameter distance: no system writes its final parameters; systems that
  record `weights_checksum` in summary.json (the baselines) get the checksum and its
  difference from the failure-free run's where both exist; the column
  final_param_distance stays empty.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.core.storage.results import read_jsonl, read_metrics, step_id_ranges
from recover.fault_injection.kinds import KINDS

from .labels import FAILURE_FREE, config_settings, variant_label
from .throughput import COLUMNS, columns, rates

RATE_COLUMNS = tuple(COLUMNS["aggregate"].values()) + ("goodput_tokens_per_s_from_first_commit",
                                                      "effective_tokens_per_s_from_first_commit", "startup_seconds")
"""The summary's throughput columns (goodput and trajectory-equivalent, per second and per process-hour, and
per second from the first commit on) and the start-up they leave out: headline averages each."""

REL_TOL = 1e-4  # relative loss difference still counted as "the same trajectory" (fp summation order is ~1e-7)

STEP_FIELDS = ["experiment", "run", "label", "system", "seed", "replicas", "shard", "tp", "pp", "step", "loss", "ref_loss", "loss_diff",
               "abs_loss_diff", "rel_loss_diff", "tokens", "cum_tokens", "wall_time", "members", "n_members",
               "generation", "ids_match", "on_trajectory", "cum_effective_tokens", "cum_process_seconds",
               "faults_fired", "faults_at_step"]
SUMMARY_FIELDS = ["experiment", "run", "label", "system", "seed", "replicas", "shard", "tp", "pp", "fault_kind", "status", "reason",
                  "steps_expected", "steps", "steps_on_trajectory", "faults_fired", "final_loss", "ref_final_loss",
                  "final_loss_diff", "max_abs_loss_diff", "max_rel_loss_diff", "train_seconds", "tokens",
                  "goodput_tokens_per_s", "effective_tokens", "effective_tokens_per_s", "process_hours",
                  "goodput_tokens_per_process_hour", "effective_tokens_per_process_hour", "startup_seconds",
                  "goodput_tokens_per_s_from_first_commit", "effective_tokens_per_s_from_first_commit", "weights_checksum", "ref_weights_checksum",
                  "weights_checksum_diff", "final_param_distance", "recovery_seconds", "detection_seconds"]


@dataclass
class Run:
    """One run directory, loaded."""

    name: str  # directory name
    label: str  # system label in figures
    system: str  # SYSTEMS key
    seed: int  # the run's seed
    replicas: int  # replicas at the start
    steps_expected: int  # steps the run was asked for
    reference: str  # name of the failure-free run to compare with ('' = none)
    fault_kind: str  # recovery experiment's fault kind ('' elsewhere)
    metrics: list[dict]  # metrics.jsonl
    summary: dict  # summary.json ({} if missing)
    faults: list[dict]  # faults.jsonl (faults that fired)
    events: list[dict]  # events.jsonl
    shard: int = 1  # ranks per replica S (config.json's train.shard; 1 for runs that predate it)
    tp: int = 1  # tensor-parallel ranks T per replica (train.tp; 1 for runs that predate it)
    pp: int = 1  # pipeline stages P per replica (train.pp; 1 for runs that predate it)

    @property
    def ranks(self) -> int:
        """Processes (GPUs) per replica: S x T x P."""
        return self.shard * self.tp * self.pp


def _label_of(config: dict) -> str:
    return variant_label(config["train"]["system"], config_settings(config))


def load_run(d: Path) -> Run | None:
    """The run in directory `d`, or None if it has no config.json (not a run)."""
    if not (d / "config.json").exists():
        return None
    config = json.loads((d / "config.json").read_text())
    spec = json.loads((d / "spec.json").read_text()) if (d / "spec.json").exists() else {}
    train = config["train"]
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    return Run(
        name=d.name, label=spec.get("label") or _label_of(config), system=train["system"],
        seed=int(train["seed"]), replicas=int(train["replicas"]), steps_expected=int(train["steps"]),
        reference=spec.get("reference", None) if spec else None, fault_kind=spec.get("fault_kind", ""),
        metrics=read_metrics(d / "metrics.jsonl"), summary=summary, faults=read_jsonl(d / "faults.jsonl"),
        events=read_jsonl(d / "events.jsonl"), shard=int(train.get("shard", 1)),
        tp=int(train.get("tp", 1)), pp=int(train.get("pp", 1)),
    )


def load_experiment(root: str | Path, experiment: str) -> list[Run]:
    base = Path(root) / experiment
    runs = [r for d in sorted(base.iterdir()) if d.is_dir() and (r := load_run(d)) is not None] if base.is_dir() else []
    by_seed = {r.seed: r.name for r in runs if r.label == FAILURE_FREE}
    for r in runs:
        if r.reference is None:  # no spec.json: the failure-free run of the same seed, if any
            r.reference = by_seed.get(r.seed, "") if r.label != FAILURE_FREE else ""
    return runs


def _fmt(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return ""
    return "" if v is None else v


# fault kinds that take a replica out of the job (the kinds table's loses_replica)
LOSING_KINDS = tuple(name for name, k in KINDS.items() if k.loses_replica)


def _process_seconds(a: float, b: float, replicas: int, losses: list[float], floor: int) -> float:
    """Process-seconds held over (a, b]: R minus the losses so far, split at each loss, >= floor."""
    points = [a] + [t for t in losses if a < t < b] + [b]
    total = 0.0
    for p, q in zip(points, points[1:]):
        lost = sum(1 for t in losses if t <= p)
        total += max(0.0, q - p) * max(floor, replicas - lost)
    return total


def step_rows(experiment: str, run: Run, ref: Run | None) -> list[dict[str, Any]]:
    """The per-step rows of one run (see the module docstring for the columns' meaning)."""
    ref_by_step = {m["step"]: m for m in (ref.metrics if ref is not None else run.metrics if run.label == FAILURE_FREE else [])}
    fault_times = sorted(f["wall_time"] for f in run.faults)
    # where each fault struck (its step in faults.jsonl), as opposed to when: a restarted
    # system re-commits earlier steps after the fault
    at_step: dict[int, int] = {}
    for f in run.faults:
        if f.get("step") is not None:
            at_step[f["step"]] = at_step.get(f["step"], 0) + 1
    rows = []
    losses = sorted(f["wall_time"] for f in run.faults if f.get("kind") in LOSING_KINDS)
    cum_tokens = cum_eff = 0
    cum_proc = 0.0
    prev_t = 0.0
    for m in run.metrics:
        r = ref_by_step.get(m["step"])
        cum_tokens += m["tokens"]
        cum_proc += run.ranks * _process_seconds(prev_t, m["wall_time"], run.replicas, losses, len(m["members"]))
        prev_t = max(prev_t, m["wall_time"])
        row: dict[str, Any] = {
            "experiment": experiment, "run": run.name, "label": run.label, "system": run.system, "seed": run.seed,
            "replicas": run.replicas, "shard": run.shard, "tp": run.tp, "pp": run.pp, "step": m["step"], "loss": m["loss"], "tokens": m["tokens"],
            "cum_tokens": cum_tokens, "wall_time": m["wall_time"], "members": " ".join(map(str, m["members"])),
            "n_members": len(m["members"]), "generation": m.get("generation", ""),
            "faults_fired": sum(1 for t in fault_times if t <= m["wall_time"]),
            "faults_at_step": at_step.get(m["step"], 0),
            "cum_process_seconds": cum_proc,
        }
        if r is not None:
            diff = m["loss"] - r["loss"]
            rel = abs(diff) / abs(r["loss"]) if r["loss"] else abs(diff)
            same_ids = step_id_ranges(m) == step_id_ranges(r)  # either form of the line
            on = same_ids and rel <= REL_TOL
            cum_eff += m["tokens"] if on else 0
            row.update(ref_loss=r["loss"], loss_diff=diff, abs_loss_diff=abs(diff), rel_loss_diff=rel,
                       ids_match=same_ids, on_trajectory=on, cum_effective_tokens=cum_eff)
        rows.append({k: _fmt(row.get(k)) for k in STEP_FIELDS})
    return rows


def _first_recovery(run: Run) -> tuple[float | None, float | None]:
    """(recovery seconds, detection seconds) of the run's first fault that fired."""
    if not run.faults:
        return None, None
    f = min(run.faults, key=lambda x: x["wall_time"])
    after = [m["wall_time"] for m in run.metrics if m["wall_time"] > f["wall_time"]]
    rec = (after[0] - f["wall_time"]) if after else None
    det = [e["detected_at"] for e in run.events
           if isinstance(e.get("detected_at"), (int, float)) and e["detected_at"] >= f["wall_time"] - 1e-3]
    return rec, (min(det) - f["wall_time"]) if det else None


def _from_first_commit(run: Run, rows: list[dict], eff: float | None) -> dict[str, Any]:
    """Start-up (the first commit's wall time: launch, imports, the first step) and both throughput
    metrics from the first commit to the last, so that a short run measures training, not start-up."""
    if not run.metrics:
        return {"startup_seconds": None}
    first, last = run.metrics[0], run.metrics[-1]
    first_on = bool(rows) and rows[0]["on_trajectory"] is True
    r = rates(sum(m["tokens"] for m in run.metrics[1:]),
              None if eff is None else eff - (first["tokens"] if first_on else 0),
              last["wall_time"] - first["wall_time"], None)
    return {"startup_seconds": first["wall_time"], "goodput_tokens_per_s_from_first_commit": r.goodput_per_s,
            "effective_tokens_per_s_from_first_commit": r.trajectory_per_s}


def summary_row(experiment: str, run: Run, ref: Run | None, rows: list[dict]) -> dict[str, Any]:
    last = run.metrics[-1] if run.metrics else None
    train_s = last["wall_time"] if last else None
    tokens = sum(m["tokens"] for m in run.metrics)
    proc_h = (rows[-1]["cum_process_seconds"] / 3600.0) if rows else None
    has_ref = ref is not None or run.label == FAILURE_FREE
    eff = rows[-1]["cum_effective_tokens"] if rows and has_ref else None
    diffs = [r["abs_loss_diff"] for r in rows if r["abs_loss_diff"] != ""]
    rels = [r["rel_loss_diff"] for r in rows if r["rel_loss_diff"] != ""]
    ref_last = (ref.metrics[-1] if ref is not None and ref.metrics else None)
    ck = run.summary.get("weights_checksum")
    ref_ck = ref.summary.get("weights_checksum") if ref is not None else None
    rec, det = _first_recovery(run)
    row = {
        "experiment": experiment, "run": run.name, "label": run.label, "system": run.system, "seed": run.seed,
        "replicas": run.replicas, "shard": run.shard, "tp": run.tp, "pp": run.pp, "fault_kind": run.fault_kind, "status": run.summary.get("status", "missing"),
        "reason": run.summary.get("reason", ""), "steps_expected": run.steps_expected, "steps": len(run.metrics),
        "steps_on_trajectory": sum(1 for r in rows if r["on_trajectory"] is True) if has_ref else None,
        "faults_fired": len(run.faults), "final_loss": last["loss"] if last else None,
        "ref_final_loss": ref_last["loss"] if ref_last else None,
        "final_loss_diff": (last["loss"] - ref_last["loss"]) if last and ref_last and last["step"] == ref_last["step"] else None,
        "max_abs_loss_diff": max(diffs) if diffs else None, "max_rel_loss_diff": max(rels) if rels else None,
        "train_seconds": train_s, "tokens": tokens, "effective_tokens": eff, "process_hours": proc_h,
        **columns(rates(tokens, eff, train_s, proc_h), "aggregate"),
        **_from_first_commit(run, rows, eff),
        "weights_checksum": ck, "ref_weights_checksum": ref_ck,
        "weights_checksum_diff": (ck - ref_ck) if ck is not None and ref_ck is not None else None,
        "final_param_distance": None, "recovery_seconds": rec, "detection_seconds": det,
    }
    return {k: _fmt(row.get(k)) for k in SUMMARY_FIELDS}


def _write(path: Path, fields: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def aggregate(root: str | Path, experiment: str) -> tuple[Path, Path, list[dict]]:
    """Write ROOT/EXP.csv and ROOT/EXP_summary.csv; return their paths and the summary rows."""
    runs = load_experiment(root, experiment)
    by_name = {r.name: r for r in runs}
    steps, summaries = [], []
    for run in runs:
        ref = by_name.get(run.reference) if run.reference else None
        rows = step_rows(experiment, run, ref)
        steps += rows
        summaries.append(summary_row(experiment, run, ref, rows))
    root = Path(root)
    p1, p2 = root / f"{experiment}.csv", root / f"{experiment}_summary.csv"
    _write(p1, STEP_FIELDS, steps)
    _write(p2, SUMMARY_FIELDS, summaries)
    return p1, p2, summaries


def headline(summaries: list[dict]) -> dict[str, Any]:
    """Per label: the largest loss difference from failure-free and the mean of each throughput metric
    (goodput and trajectory-equivalent, per second and per process-hour); recover over ckpt-restart."""
    out: dict[str, Any] = {}
    for row in summaries:
        d = out.setdefault(row["label"], {"runs": 0, "max_abs_loss_diff": 0.0, "max_rel_loss_diff": 0.0,
                                          **{k: [] for k in RATE_COLUMNS}})
        d["runs"] += 1
        for k in ("max_abs_loss_diff", "max_rel_loss_diff"):
            if row[k] != "":
                d[k] = max(d[k], float(row[k]))
        for k in RATE_COLUMNS:
            if row[k] != "":
                d[k].append(float(row[k]))
    for d in out.values():
        per_run = d["effective_tokens_per_s_from_first_commit"]
        # how far apart runs of one label are (two failure-free runs of one set-up measure the machine's noise)
        d["effective_tokens_per_s_from_first_commit_spread"] = (max(per_run) / min(per_run)
                                                                if len(per_run) > 1 and min(per_run) > 0 else None)
        for k in RATE_COLUMNS:
            d[k] = sum(d[k]) / len(d[k]) if d[k] else None
    rec, ckpt = out.get("recover"), out.get("ckpt-restart")
    if rec and ckpt and rec["effective_tokens_per_s"] and ckpt["effective_tokens_per_s"]:
        out["recover_over_ckpt_restart"] = {k: rec[k] / ckpt[k] for k in RATE_COLUMNS
                                            if rec[k] and ckpt[k] and k != "startup_seconds"}
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiments", nargs="+")
    ap.add_argument("--results", default="results")
    a = ap.parse_args(argv)
    for exp in a.experiments:
        p1, p2, s = aggregate(a.results, exp)
        print(f"{exp}: {len(s)} runs -> {p1}, {p2}")
        print(json.dumps(headline(s), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
