"""Where the coordinator benchmarks' results go: one JSON file per run and the figure drawn from them.

Contract: `write_results(result, out, name, figure)` writes OUT/NAME.json and, when
`figure`, redraws paper_figs/coordinator_scale.py's figure from every coordinator
result in OUT: into paper_figs/ when OUT is results/bench, else into OUT itself.
Used by both `recover bench coordinator` (the state machine) and its `--service`
run; it imports no torch, so the service bench stays torch-free.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_results(result: dict, out: Path, name: str, figure: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    if figure:
        figs = REPO / "paper_figs"
        # results/bench's figure belongs to paper_figs/; any other results folder gets its own
        dest = figs if out.resolve() == (REPO / "results" / "bench").resolve() else out
        subprocess.run([sys.executable, str(figs / "coordinator_scale.py"), "--results", str(out), "--out", str(dest)],
                       check=True)
    return path
