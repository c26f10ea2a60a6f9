"""The effective-throughput figure: effective tokens against wall time and against process-hours.

Reads RESULTS/throughput.csv and throughput_summary.csv only (see exp_common). Effective
tokens are the tokens of committed iterations on the failure-free trajectory (same
microbatch ids, loss within the aggregation's tolerance: experiments/aggregate.py). Left:
running effective tokens against wall-clock seconds; middle: against process-hours (live
processes x time); x marks: faults. Right: both throughput metrics per system
(experiments/throughput.py): trajectory-equivalent (solid) and goodput (hatched), tokens per
second from each run's first commit (start-up, `startup_seconds`, is reported apart: it
measures process launch, not training), mean over seeds, dots: seeds; its title gives how far
apart the failure-free runs are, the machine's noise that every ratio should be read against.
"""
from __future__ import annotations

import sys
from pathlib import Path

from matplotlib.patches import Patch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exp_common import args, fault_points, load, order, palette, plt, save, sns, theme  # noqa: E402


def main(results: str, experiment: str, out: str, name: str) -> list[Path]:
    df, summary = load(results, experiment)
    theme()
    labels = order(df["label"])
    pal = palette(labels)
    df = df.dropna(subset=["cum_effective_tokens"]).copy()
    df["process_hours"] = df["cum_process_seconds"] / 3600.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    for ax, x, xlabel in ((axes[0], "wall_time", "wall time (s)"), (axes[1], "process_hours", "process-hours")):
        sns.lineplot(df, x=x, y="cum_effective_tokens", hue="label", hue_order=labels, palette=pal, units="run",
                     estimator=None, ax=ax, legend=ax is axes[0])
        f = fault_points(df)
        ax.scatter(f[x], f["cum_effective_tokens"], marker="x", color="black", s=25, zorder=5, label="fault")
        ax.set(xlabel=xlabel, ylabel="effective tokens (on the failure-free trajectory)")
    axes[0].set_title("effective tokens vs wall time")
    axes[1].set_title("effective tokens vs process-hours")
    # Both throughput metrics (experiments/throughput.py): trajectory-equivalent (solid) and
    # goodput (hatched: every committed token, the shrunk-batch systems' included).
    eff, good = "effective_tokens_per_s_from_first_commit", "goodput_tokens_per_s_from_first_commit"
    s = summary.dropna(subset=[eff])
    shown = [x for x in labels if x in set(s["label"])]
    for i, lab in enumerate(shown):
        rows = s[s["label"] == lab]
        for dx, col, kw in ((-0.2, eff, {}), (0.2, good, {"hatch": "//", "alpha": 0.45})):
            axes[2].bar(i + dx, rows[col].mean(), width=0.38, color=pal[lab], edgecolor=pal[lab], **kw)
            axes[2].scatter([i + dx] * len(rows), rows[col], color="black", s=10, zorder=5)
    axes[2].set_xticks(range(len(shown)), shown)
    axes[2].legend(handles=[Patch(facecolor="0.4", label="trajectory-equivalent"),
                            Patch(facecolor="0.4", alpha=0.45, hatch="//", label="goodput (all committed tokens)")],
                   fontsize=8)
    ff = s[s["label"] == "failure-free"][eff]
    spread = f"\nfailure-free runs {ff.max() / ff.min():.2f}x apart" if len(ff) > 1 and ff.min() > 0 else ""
    axes[2].set(xlabel="", ylabel="tokens / s")
    axes[2].set_title(f"from the first commit (mean over seeds; dots: seeds){spread}", fontsize=10)
    axes[2].tick_params(axis="x", rotation=30)
    fig.suptitle(f"{experiment}: successive failures at a per-GPU failure rate; x = a fault fired", y=1.06)
    return save(fig, out, name)


if __name__ == "__main__":
    a = args(__doc__.split("\n")[0], "throughput", "throughput")
    main(a.results, a.experiment, a.out, a.name)
