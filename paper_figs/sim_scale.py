"""Figure: effective throughput and ETTR against cluster size (512 to 100k GPUs), per system.

Reads results/sim/scale/scale.csv (`recover simulate scale`); writes
paper_figs/sim_scale.{png,pdf}. Left: trajectory-equivalent throughput as a fraction of
the failure-free job's; middle: goodput (all kept tokens) likewise; right: ETTR. A
settings variant (ckpt-restart-async, torchft-hb5s, elastic-keep-global-lastcall30s) is
drawn dashed in its system's colour (style.py). Llama 3's per-GPU failure rate, 30 days, replicas of
128 GPUs replaced after an hour (see results/sim/scale and docs/simulator.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_common import args, dashes, order, palette, plt, save, sns, theme  # noqa: E402


def main(results: str, out: str) -> list[Path]:
    df = pd.read_csv(Path(results) / "scale" / "scale.csv")
    theme()
    panels = [("effective_throughput_vs_failure_free", "trajectory-equivalent / failure-free"),
              ("goodput_vs_failure_free", "goodput / failure-free"), ("ettr", "ETTR")]
    panels = [p for p in panels if p[0] in df.columns]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), sharex=True)
    systems = order(df.system)
    pal = palette(systems)
    for ax, (col, label) in zip(axes, panels):
        sns.lineplot(data=df, x="gpus", y=col, hue="system", hue_order=systems, palette=pal, marker="o",
                     style="system", style_order=systems, dashes=dashes(systems), ax=ax, errorbar=None)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.get_legend().remove()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, -0.2))
    fig.suptitle("Simulated, at Llama 3's failure rate (30 days)", fontsize=10)
    return save(fig, out, "sim_scale")


if __name__ == "__main__":
    a = args(__doc__.splitlines()[0])
    print("\n".join(str(p) for p in main(a.results, a.out)))
