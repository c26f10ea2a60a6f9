"""Figure: effective tokens against GPU-hours per system in the simulated paper-512 scenario.

Reads results/sim/paper-512/{summary.json,timeseries.csv}; writes
paper_figs/sim_tokens_vs_gpu_hours.{png,pdf}. The vertical line is the paper's 234
GPU-hour point; the title states the simulated ratios beside the paper's 2.23x and 74.9%.
Dotted lines: all tokens of the systems that shrink the batch (off the failure-free
trajectory, so not effective). Dashed: a settings variant, in its system's colour.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_common import args, linestyle, order, palette, plt, save, theme  # noqa: E402


def main(results: str, out: str) -> list[Path]:
    d = Path(results) / "paper-512"
    summary = json.loads((d / "summary.json").read_text())
    ts = pd.read_csv(d / "timeseries.csv")
    theme()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    systems = order(ts.system)
    pal = palette(systems)
    for system in systems:
        t = ts[ts.system == system]
        ax.plot(t.gpu_hours, t.effective_tokens / 1e6, color=pal[system], label=system, lw=1.8,
                ls=linestyle(system))
        if (t.tokens - t.effective_tokens).abs().max() > 0:
            ax.plot(t.gpu_hours, t.tokens / 1e6, color=pal[system], lw=1, ls=":")
    mark = summary.get("ratio_recover_over_ckpt_restart", {}).get("gpu_hour_mark") or 234.0
    ax.axvline(mark, color="0.3", lw=1, ls="--")
    ax.text(mark, ax.get_ylim()[1] * 0.97, f" {mark:g} GPU-h", va="top", fontsize=8)
    r = summary.get("ratio_recover_over_ckpt_restart", {})
    paper = summary.get("paper", {})
    title = "paper-512 (simulated)"
    if r.get("effective_throughput"):
        title += f": recover/{summary.get('comparator', 'ckpt-restart')} {r['effective_throughput']:.2f}x " \
                 "trajectory-equivalent"
        if r.get("more_tokens_percent_at_gpu_hour_mark") is not None:
            title += f", +{r['more_tokens_percent_at_gpu_hour_mark']:.0f}% tokens at {mark:g} GPU-h"
    if paper:
        title += f"\n(paper: {paper['effective_throughput_ratio']}x, +{paper['more_tokens_percent_at_gpu_hours']}%)"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("GPU-hours held")
    ax.set_ylabel("trajectory-equivalent tokens (millions)")
    ax.plot([], [], color="0.4", lw=1, ls=":", label="goodput: all kept tokens (shrunk batches)")
    ax.legend(fontsize=8, loc="upper left")
    return save(fig, out, "sim_tokens_vs_gpu_hours")


if __name__ == "__main__":
    a = args(__doc__.splitlines()[0])
    print("\n".join(str(p) for p in main(a.results, a.out)))
