"""`make demo`: the main job, end to end on this machine.

Contract: trains the tiny model with 4 replicas twice with the same seed - once
failure-free (the plain data-parallel reference) and once with ReCoVer while two
of the four replicas are SIGKILLed at different phases (one in the middle of the
gradient all-reduce) - then prints both loss trajectories side by side, the
largest difference, and how long each recovery took. Exits non-zero if either
run failed, or if a step of the faulty run folded other ids than the reference's. Results land under runs/demo/.

Then it is a small trajectory experiment: every other registered system
(checkpoint-restart, torchft, elastic in both settings: grids.FAULTY_SYSTEMS)
trains under the same plan, a compact side-by-side table shows each one's loss
difference from failure-free, runs/demo.csv is aggregated, and the trajectory
figure is drawn to runs/demo/trajectory.png (its path printed). A baseline that
fails is reported, not fatal: the demo's verdict is the two runs above.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from recover.core.config.train_config import TrainConfig
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids, step_id_ranges, step_ids
from recover.fault_injection.injector import attach_plan

from .run import run_training

OUT = Path("runs/demo")
STEPS = 30
FAULTS = [
    {"kind": "crash", "replica": 1, "step": 8, "phase": "backward", "microbatch": 1},
    {"kind": "crash", "replica": 2, "step": 19, "phase": "allreduce"},
]


def main() -> int:
    common = dict(replicas=4, microbatches=8, steps=STEPS, seed=0)
    OUT.mkdir(parents=True, exist_ok=True)
    plan_path = OUT / "plan.json"
    plan_path.write_text(json.dumps({"faults": FAULTS}, indent=1))

    print(f"1/2 failure-free reference: plain data parallel, 4 replicas, M=8, {STEPS} steps ...", flush=True)
    ref_cfg = TrainConfig(system="plain", out=str(OUT / "failure_free"), **common)
    ref = run_training(ref_cfg)
    print("2/2 ReCoVer with replica 1 killed in backward (step 8) and replica 2 killed during "
          "the all-reduce (step 19) ...", flush=True)
    rec_cfg = TrainConfig(system="recover", out=str(OUT / "recover_2_crashes"), faults=str(plan_path), **common)
    rec = run_training(rec_cfg, plan=attach_plan(rec_cfg))
    if ref["status"] != "ok" or rec["status"] != "ok":
        print(f"demo failed: reference {ref['status']} {ref['reason']}; recover {rec['status']} {rec['reason']}")
        return 1

    a = read_metrics(Path(ref_cfg.out) / "metrics.jsonl")
    b = read_metrics(Path(rec_cfg.out) / "metrics.jsonl")
    events = [e for e in read_jsonl(Path(rec_cfg.out) / "events.jsonl") if e["kind"] == "recovery"]
    fired = read_jsonl(Path(rec_cfg.out) / "faults.jsonl")
    if not print_trajectories(a, b, events, fired, common["microbatches"]):
        return 1
    print(f"\nresults: {ref_cfg.out}/ and {rec_cfg.out}/ (metrics.jsonl, events.jsonl, faults.jsonl, logs/)")
    others_table(common, plan_path, a, b)
    return 0


def print_trajectories(a: list[dict], b: list[dict], events: list[dict], fired: list[dict], m: int) -> bool:
    """The two runs side by side (metrics lines as `read_metrics` gives them), then each
    recovery; False when the faulty run's steps do not match the reference's, step for step."""
    recovered_at = {e["step"]: e for e in events}
    print(f"\n{'step':>4}  {'failure-free':>12}  {'recover':>10}  {'|diff|':>9}  replicas")
    worst = 0.0
    for x, y in zip(a, b):
        d = abs(x["loss"] - y["loss"])
        worst = max(worst, d / abs(x["loss"]))
        mark = "  <- replica lost, recovered" if y["step"] in recovered_at else ""
        print(f"{x['step']:>4}  {x['loss']:>12.6f}  {y['loss']:>10.6f}  {d:>9.2e}  {y['members']}{mark}")
    print(f"\nlargest relative loss difference: {worst:.2e} (floating-point summation order only)")
    # recover's side from what its members reported folding, not what was handed out
    same = len(a) == len(b) and all(step_ids(x) == reported_ids(y) for x, y in zip(a, b))
    print(f"every step of the faulty run folded exactly the same {m} microbatch ids: {same}")
    for f, e in zip(fired, events):
        print(f"recovery at step {e['step']}: replica {f['replica']} killed in {f['phase']}; detected "
              f"{1e3 * (e['detected_at'] - f['wall_time']):.0f} ms after the kill; next step committed "
              f"{1e3 * e['recovery_seconds']:.0f} ms after detection; survivors {e['survivors']} "
              f"redid {len(e['redone'])} microbatches")
    return same


def others_table(common: dict, plan_path: Path, ref: list[dict], rec: list[dict]) -> None:
    """The other systems under the same plan, side by side, then the trajectory figure."""
    import subprocess

    from .aggregate import aggregate
    from .grids import FAULTY_SYSTEMS
    from .systems import SYSTEMS

    variants = [v for v in FAULTY_SYSTEMS if v.system in SYSTEMS and v.label != "recover"]
    cols: dict[str, dict[int, dict]] = {"recover": {m["step"]: m for m in rec}}
    for i, v in enumerate(variants):
        print(f"\n+{i + 1}/{len(variants)} {v.label} under the same plan ...", flush=True)
        cfg = TrainConfig(system=v.system, out=str(OUT / v.label), faults=str(plan_path), **common)
        settings = SYSTEMS[v.system].settings(**dict(v.settings))
        summary = run_training(cfg, plan=attach_plan(cfg), settings=settings)
        if summary["status"] != "ok":
            print(f"  {v.label} {summary['status']}: {summary['reason']} (logs: {cfg.out}/logs/)")
        cols[v.label] = {m["step"]: m for m in read_metrics(Path(cfg.out) / "metrics.jsonl")}
    print("\n|loss - failure-free loss| per step ('-': step not committed; '*': a different set of microbatches)")
    print(f"{'step':>4}  {'failure-free':>12}  " + "  ".join(f"{k:>{max(10, len(k))}}" for k in cols))
    for x in ref:
        cells = []
        for k, c in cols.items():
            m = c.get(x["step"])
            cell = "-" if m is None else f"{abs(m['loss'] - x['loss']):.1e}" + (
                "*" if step_id_ranges(m) != step_id_ranges(x) else " ")
            cells.append(f"{cell:>{max(10, len(k))}}")
        print(f"{x['step']:>4}  {x['loss']:>12.6f}  " + "  ".join(cells))
    aggregate(OUT.parent, OUT.name)
    script = Path(__file__).resolve().parent.parent / "paper_figs" / "trajectory.py"
    proc = subprocess.run([sys.executable, str(script), "--results", str(OUT.parent), "--experiment", OUT.name,
                           "--out", str(OUT), "--name", "trajectory"], capture_output=True, text=True)
    if proc.returncode == 0:
        print(f"\ntrajectory figure: {OUT / 'trajectory.png'} (and .pdf); per-step table: {OUT.parent / 'demo.csv'}")
    else:
        print(f"\ntrajectory figure failed: {proc.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    sys.exit(main())
