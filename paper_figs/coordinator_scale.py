"""The coordinator figure: one commit's and one recovery round's cost against the number of replicas R.

Reads RESULTS/coordinator_state_machine.json (written by `recover bench coordinator`)
and, when present, RESULTS/coordinator_state_machine_before.json (the same benchmark
run on the code before the linear-cost change) and RESULTS/coordinator_state_machine_nogc.json
(`--no-gc`: the share of Python's garbage collector); never runs anything. Log-log, one
panel per round (commit, recovery), solid: state machine + parsing, dashed: encoding
what it answered, grey: parsing the inbound messages alone; the horizontal line is the
50 ms target. Writes
coordinator_scale.png and .pdf into --out (default: paper_figs/). A missing results
file ends the script with one line naming it and exit code 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exp_common import HERE, ROOT, plt, save, theme  # noqa: E402

TARGET_S = 0.050  # the bound on a commit and on a recovery round at R = 16384
SERIES = {"coordinator_state_machine_before": ("before", "#0072B2"), "coordinator_state_machine": ("now", "#D55E00"),
          "coordinator_state_machine_nogc": ("now, garbage collector off", "#009E73")}


def main(results: str, out: str, name: str = "coordinator_scale") -> list[Path]:
    runs = {}
    for stem, (label, colour) in SERIES.items():
        p = Path(results) / f"{stem}.json"
        if p.exists():
            runs[label] = (json.loads(p.read_text())["rows"], colour)
        elif stem == "coordinator_state_machine":
            sys.exit(f"missing {p}: run `recover bench coordinator` first (or point --results at it)")
    theme()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (key, title) in zip(axes, [("commit", "one commit (R votes)"), ("recovery", "one recovery round")]):
        for label, (rows, colour) in runs.items():
            R = [r["replicas"] for r in rows]
            ax.plot(R, [r[f"{key}_s"] for r in rows], "o-", color=colour, label=f"{label}: state machine + parse")
            ax.plot(R, [r[f"{key}_encode_s"] for r in rows], "s--", color=colour, alpha=0.6,
                    label=f"{label}: encoding the answers")
            if label == "now" and f"{key}_parse_s" in rows[0]:  # the floor: json.loads of the R messages
                ax.plot(R, [r[f"{key}_parse_s"] for r in rows], "^:", color="grey", label="now: parsing alone")
        ax.axhline(TARGET_S, color="black", lw=0.8, ls=":", label="50 ms target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(title=title, xlabel="replicas R (8 microbatches each)", ylabel="seconds")
    axes[0].legend(fontsize=7)
    fig.suptitle("coordinator cost against R (core.protocol.Membership, in process)")
    return save(fig, out, name)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(ROOT / "results" / "bench"), help="folder holding the bench JSON")
    ap.add_argument("--out", default=str(HERE), help="folder for the PNG and PDF")
    a = ap.parse_args()
    main(a.results, a.out)
