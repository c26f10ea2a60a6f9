"""The recovery figure: time from a fault to the next committed iteration against the number of replicas.

Reads RESULTS/recovery_summary.csv only (see exp_common): one run per (system, fault
kind, replica count, seed), one fault each; recovery_seconds = wall time of the first
commit after the fault minus the fault's time (experiments/aggregate.py). One panel
per fault kind, one line per system, log-scaled time; a settings variant (recover-hb10s:
recover's hang detection at the baselines' 10 s) dashed in its system's colour.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exp_common import args, dashes, load, order, palette, plt, save, sns, theme  # noqa: E402


def main(results: str, experiment: str, out: str, name: str) -> list[Path]:
    _, summary = load(results, experiment)
    theme()
    s = summary.dropna(subset=["recovery_seconds"])
    kinds = sorted(s["fault_kind"].dropna().unique()) or ["?"]
    labels = order(s["label"])
    pal = palette(labels)
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        d = s[s["fault_kind"] == kind]
        sns.lineplot(d, x="replicas", y="recovery_seconds", hue="label", hue_order=labels, palette=pal,
                     style="label", style_order=labels, dashes=dashes(labels), marker="o", errorbar=None, ax=ax,
                     legend=ax is axes[0][0])
        ax.set_yscale("log")
        ax.set(title=f"fault: {kind}", xlabel="replicas", ylabel="fault -> next committed iteration (s)")
        ax.set_xticks(sorted(s["replicas"].unique()))
    fig.suptitle(f"{experiment}: recovery time against replicas, per system")
    return save(fig, out, name)


if __name__ == "__main__":
    a = args(__doc__.split("\n")[0], "recovery", "recovery")
    main(a.results, a.experiment, a.out, a.name)
