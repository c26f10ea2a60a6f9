"""Shared set-up of the simulator's figure scripts (paper_figs/sim_*.py).

Contract: every sim figure script reads results/sim/ only (never runs the simulator)
and writes NAME.png and NAME.pdf into paper_figs/ (or --out); `--results` points it at
another results folder (the tests use small fixtures). Matplotlib runs headless (Agg).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display here or in CI

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from style import dashes, linestyle, order, palette  # noqa: E402,F401 - one colour per system, every figure


def args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--results", default=str(ROOT / "results" / "sim"), help="results/sim folder to read")
    ap.add_argument("--out", default=str(HERE), help="folder for the PNG and PDF")
    return ap.parse_args()


def save(fig, out: str | Path, name: str) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def theme() -> None:
    sns.set_theme(style="whitegrid", context="paper")
