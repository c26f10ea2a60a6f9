"""Figure: how paper-512's recover / checkpoint-restart ratio depends on what the paper does not state.

Reads results/sim/sensitivity/{restart_x_interval.csv,loss_unit.csv,
restart_matching_paper.json} (`recover simulate sensitivity`); writes
paper_figs/sim_sensitivity.{png,pdf}. Left: the effective-throughput ratio over restart
time x checkpoint interval (the Young/Daly column first; "inf": checkpoint-restart kept
nothing); right: the ratio against the
loss unit (GPUs per replica; 256 GPUs lost in 256/unit events). The paper's 2.23x is
the dashed line. Third panel (restart_x_save.csv): the ratio over restart time x checkpoint
stall (a blocking save's length, or an async save's snapshot), cells within 10% of 2.23x in
brackets, and a star where paper-512 as calibrated sits (results/sim/paper-512/summary.json).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_common import args, plt, save, sns, theme  # noqa: E402

PAPER_RATIO = 2.23


def main(results: str, out: str) -> list[Path]:
    d = Path(results) / "sensitivity"
    grid = pd.read_csv(d / "restart_x_interval.csv")
    units = pd.read_csv(d / "loss_unit.csv")
    theme()
    saves_csv = d / "restart_x_save.csv"
    n = 3 if saves_csv.is_file() else 2
    fig, axes = plt.subplots(1, n, figsize=(5.0 * n, 3.8), gridspec_kw={"width_ratios": [1.5, 1, 1.4][:n]})
    grid["interval"] = grid.apply(
        lambda r: f"Y/D ({int(r.interval_iterations)})" if r.checkpoint_every == "young-daly"
        else str(int(r.interval_iterations)), axis=1)
    cols = list(dict.fromkeys(grid.sort_values(["checkpoint_every"], key=lambda s: s.map(
        lambda v: -1 if v == "young-daly" else int(v))).interval))
    pivot = grid.pivot(index="restart_seconds", columns="interval", values="ratio_effective_throughput")[cols]
    # An empty ratio means checkpoint-restart kept nothing at all (failures outpace its checkpoints): infinite.
    labels = pivot.map(lambda v: "inf" if pd.isna(v) else f"{v:.1f}")
    sns.heatmap(pivot.fillna(pivot.max().max()), annot=labels, fmt="", cmap="viridis", ax=axes[0],
                norm=LogNorm(vmin=1, vmax=max(2.0, float(pivot.max().max()))),
                cbar_kws={"label": "recover / ckpt-restart (log)"}, annot_kws={"fontsize": 7})
    axes[0].set_xlabel("checkpoint interval (iterations; Y/D = Young/Daly)")
    axes[0].set_ylabel("restart time (s)")
    axes[0].set_title("effective-throughput ratio", fontsize=9)
    sns.lineplot(data=units, x="gpus_per_replica", y="ratio_effective_throughput", marker="o", ax=axes[1],
                 label="effective throughput")
    sns.lineplot(data=units, x="gpus_per_replica", y="ratio_last_quarter", marker="s", ax=axes[1],
                 label="last quarter of the run")
    axes[1].axhline(PAPER_RATIO, color="0.3", ls="--", lw=1, label=f"paper {PAPER_RATIO}x")
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("GPUs per replica (loss unit)")
    axes[1].set_ylabel("recover / ckpt-restart")
    axes[1].legend(fontsize=7)
    m = d / "restart_matching_paper.json"
    if m.is_file():
        rs = json.loads(m.read_text()).get("restart_seconds")
        if rs is not None:
            axes[1].set_title(f"the paper's 2.23x needs a ~{rs:.0f} s restart here", fontsize=9)
    if n == 3:
        sv = pd.read_csv(saves_csv)
        piv = sv.pivot(index="restart_seconds", columns="save_stall_seconds", values="ratio_effective_throughput")
        # Mark the cells within 10% of the paper's 2.23x with a box.
        lab = piv.map(lambda v: "inf" if pd.isna(v) else (f"[{v:.2f}]" if abs(v / PAPER_RATIO - 1) <= 0.10
                                                           else f"{v:.1f}"))
        sns.heatmap(piv.fillna(piv.max().max()), annot=lab, fmt="", cmap="viridis", ax=axes[2],
                    norm=LogNorm(vmin=1, vmax=max(2.0, float(piv.max().max()))), cbar=False, annot_kws={"fontsize": 7})
        axes[2].set_xlabel("checkpoint stall per save (s; load = 2x)")
        axes[2].set_ylabel("restart time (s)")
        axes[2].set_title(f"Young/Daly interval; [x]: within 10% of {PAPER_RATIO}x", fontsize=9)
        # Where the calibrated paper-512 sits (results/sim/paper-512: the bench-anchored restart and the
        # comparator's measured stall per save), placed on the grid's log axes between the cells.
        p512 = d.parent / "paper-512" / "summary.json"
        if p512.is_file():
            summ = json.loads(p512.read_text())
            vals = {r["name"]: r["value"] for r in summ["calibration"]["values"]}
            restart, stall = vals.get("restart_seconds"), summ["checkpoint"].get("checkpoint_stall_seconds")
            if restart and stall:
                def at(v, ticks):
                    return float(np.interp(np.log(v), np.log(np.asarray(ticks, float)), np.arange(len(ticks)))) + 0.5
                axes[2].plot(at(stall, piv.columns), at(restart, piv.index), marker="*", ms=14, color="red",
                             markeredgecolor="white", label=f"paper-512 as calibrated ({restart:.0f} s, {stall:.1f} s)")
                axes[2].legend(fontsize=7, loc="lower right")
    return save(fig, out, "sim_sensitivity")


if __name__ == "__main__":
    a = args(__doc__.splitlines()[0])
    print("\n".join(str(p) for p in main(a.results, a.out)))
