"""`recover figs`: regenerate every paper figure from results/ (no training).

Contract: it runs every figure script in paper_figs/: each `paper_figs/*.py`
whose name does not start with "_" and does not end in "_common.py" and that has
a `__main__` block (the simulator's sim_*.py scripts included), each in its own
process from the repository's root. The scripts read results/ only. It prints
one line per script (ok or FAILED, and its time) and exits 1 if any failed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIGS = REPO / "paper_figs"


def figure_scripts(folder: Path = FIGS) -> list[Path]:
    """The figure scripts of `folder`, by the naming convention of the module docstring."""
    out = []
    for p in sorted(folder.glob("*.py")):
        if p.name.startswith("_") or p.name.endswith("_common.py"):
            continue
        if "__main__" in p.read_text():
            out.append(p)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("figs", help="regenerate every paper figure from results/ (no training)",
                       description="Run every figure script in paper_figs/ (PNG and PDF beside them).")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="only these scripts (file stems)")
    p.set_defaults(func=cmd_figs)


def cmd_figs(args: argparse.Namespace) -> int:
    scripts = figure_scripts()
    if args.only:
        scripts = [s for s in scripts if s.stem in args.only]
    failed = []
    for s in scripts:
        t = time.time()
        proc = subprocess.run([sys.executable, str(s)], cwd=REPO, capture_output=True, text=True)
        ok = proc.returncode == 0
        print(f"{'ok' if ok else 'FAILED':>6}  {s.relative_to(REPO)}  ({time.time() - t:.1f}s)")
        for line in (proc.stdout.strip().splitlines() if ok else (proc.stdout + proc.stderr).strip().splitlines()[-15:]):
            print(f"        {line}")
        if not ok:
            failed.append(s.name)
    if failed:
        print(f"{len(failed)} figure script(s) failed: {', '.join(failed)}")
    return 1 if failed else 0
