"""The trajectory figure: loss against step for every system, and |difference from failure-free| (log scale).

Reads RESULTS/trajectory.csv only (see exp_common). Left: each system's loss per step
(mean over seeds). Right: |loss - failure-free loss| at the same step and seed, one
line per run, on a log scale; a difference of exactly 0 is drawn at the floor (FLOOR)
so that it stays visible. Red dotted lines mark the steps at which faults struck.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exp_common import args, fault_points, load, order, palette, plt, save, sns, theme  # noqa: E402

FLOOR = 1e-9  # where an exact 0 difference is drawn on the log axis


def main(results: str, experiment: str, out: str, name: str) -> list[Path]:
    df, _ = load(results, experiment)
    theme()
    labels = order(df["label"])
    pal = palette(labels)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    sns.lineplot(df, x="step", y="loss", hue="label", hue_order=labels, palette=pal, errorbar=None, lw=1, ax=a)
    a.set(title="loss per step (mean over seeds)", ylabel="training loss")
    a.legend(loc="lower left", fontsize="small")
    faulty = df[df["label"] != "failure-free"].dropna(subset=["abs_loss_diff"]).copy()
    faulty["abs_loss_diff"] = faulty["abs_loss_diff"].clip(lower=FLOOR)
    if len(faulty):
        sns.lineplot(faulty, x="step", y="abs_loss_diff", hue="label", hue_order=[x for x in labels if x != "failure-free"],
                     palette=pal, units="run", estimator=None, alpha=0.8, ax=b, legend=False)
    b.set_yscale("log")
    b.set(title="|loss - failure-free loss| (each seed; 0 drawn at 1e-9)", ylabel="absolute loss difference")
    for step in sorted(set(fault_points(df)["step"])):
        for ax in (a, b):
            ax.axvline(step, color="tab:red", alpha=0.5, lw=0.8, ls=":", zorder=1)
    n_seeds = df["seed"].nunique()
    fig.suptitle(f"{experiment}: {n_seeds} seed(s); red dotted lines: steps at which a fault struck")
    return save(fig, out, name)


if __name__ == "__main__":
    a = args(__doc__.split("\n")[0], "trajectory", "trajectory")
    main(a.results, a.experiment, a.out, a.name)
