"""Shared set-up of the experiment figure scripts (paper_figs/trajectory.py, throughput.py, recovery.py).

Contract: a figure script reads the aggregated CSVs of one experiment, RESULTS/EXP.csv and
RESULTS/EXP_summary.csv (written by `recover experiment` / experiments.aggregate), never a
run directory and never training; it writes NAME.png and NAME.pdf into --out (default:
paper_figs/). `--results` and `--experiment` point it elsewhere (the tests use fixtures,
`make demo` its own runs). Matplotlib runs headless (Agg). A missing CSV ends the script
with one line naming it and exit code 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display here or in CI

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from style import LABEL_ORDER, PALETTE, dashes, order, palette  # noqa: E402,F401 - one colour per system, every figure


def args(description: str, experiment: str, name: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--results", default=str(ROOT / "results"), help="folder holding EXP.csv and EXP_summary.csv")
    ap.add_argument("--experiment", default=experiment, help=f"experiment to draw (default: {experiment})")
    ap.add_argument("--out", default=str(HERE), help="folder for the PNG and PDF")
    ap.add_argument("--name", default=name, help=f"file stem of the figure (default: {name})")
    return ap.parse_args()


def load(results: str | Path, experiment: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    steps, summary = Path(results) / f"{experiment}.csv", Path(results) / f"{experiment}_summary.csv"
    for p in (steps, summary):
        if not p.exists():
            sys.exit(f"missing {p}: run `recover experiment {experiment}` first (or point --results at it)")
    return pd.read_csv(steps), pd.read_csv(summary)


def fault_points(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the steps during which a fault struck (faults_at_step > 0), one per (run, step)."""
    return df[df["faults_at_step"] > 0]


def save(fig, out: str | Path, name: str) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight", metadata={"CreationDate": None})  # reproducible bytes
    plt.close(fig)
    for p in paths:
        print(f"wrote {p}")
    return paths


def theme() -> None:
    sns.set_theme(style="whitegrid", context="paper")
