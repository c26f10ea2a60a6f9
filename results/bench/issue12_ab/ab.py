"""Interleaved A/B of two checkouts' `recover train`: wall per step and CPU per step.

Wall per step = the median interval between consecutive commits over steps 5..59 of one
60-step run (start-up excluded). Rounds alternate the configurations so load drifts hit all
alike; the figure to read is the median over rounds.
"""
import json, statistics, subprocess, sys, tempfile, time
from pathlib import Path

CHECKOUTS = {"before": "/work/wt/before", "after": "/work/main"}
CONFIGS = [("before", "recover", []), ("after", "recover", []), ("after", "recover", ["--digest-every", "0"]),
           ("before", "plain", []), ("after", "plain", [])]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("ab.json")
SHORT, LONG = 20, 60

def run(tree, system, extra, steps, out):
    cmd = [f"{CHECKOUTS[tree]}/.venv/bin/recover", "train", "--system", system, "--replicas", "4",
           "--microbatches", "8", "--steps", str(steps), "--out", out, "--no-progress", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=CHECKOUTS[tree])
    ms = [json.loads(l) for l in open(Path(out) / "metrics.jsonl")]
    ts = [m["wall_time"] for m in ms if m["step"] >= 5]
    return None, statistics.median(b - a for a, b in zip(ts, ts[1:]))

rows = []
work = Path(tempfile.mkdtemp(prefix="ab-"))
for rnd in range(ROUNDS):
    for i, (tree, system, extra) in enumerate(CONFIGS):
        _, wall = run(tree, system, extra, LONG, str(work / f"{rnd}_{i}"))
        row = {"round": rnd, "tree": tree, "system": system, "extra": " ".join(extra), "wall_per_step_s": wall}
        rows.append(row); print(json.dumps(row), flush=True)

def name(r): return f"{r['tree']}/{r['system']}{(' ' + r['extra']) if r['extra'] else ''}"
summary = {}
for r in rows:
    summary.setdefault(name(r), []).append(r["wall_per_step_s"])
med = {k: {"wall_per_step_s_median": statistics.median(v), "wall_per_step_s": v} for k, v in summary.items()}
OUT.write_text(json.dumps({"command": " ".join(sys.argv), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "checkouts": {k: subprocess.run(["git", "-C", v, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() for k, v in CHECKOUTS.items()},
                           "rounds": rows, "summary": med}, indent=2))
for k, v in med.items():
    print(f"{k:<32} wall/step {v['wall_per_step_s_median']*1e3:6.1f} ms  (rounds: {' '.join(f'{x*1e3:.1f}' for x in v['wall_per_step_s'])})")
