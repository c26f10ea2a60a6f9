"""The coordinator figure: one commit's and one recovery round's cost against the number of replicas R.

Reads RESULTS/coordinator_state_machine.json (written by `recover bench coordinator`)
and, when present, RESULTS/coordinator_state_machine_before.json (the same benchmark
run on the code before the linear-cost change) and RESULTS/coordinator_state_machine_nogc.json
(`--no-gc`: the share of Python's garbage collector); never runs anything. Log-log, one
panel per round (commit, recovery), solid: state machine + parsing, dashed: encoding
what it answered, grey: parsing the inbound messages alone; the horizontal line is the
50 ms target. When RESULTS/coordinator_service.json is there (`recover bench coordinator
--service`: the real membership service against N simulated replicas over loopback), and
RESULTS/coordinator_service_before.json beside it (the same bench before the heartbeat
strategy) and RESULTS/coordinator_service_step2s.json (`--step-seconds 2`), a second row draws, against N: the step latency (last vote read -> commits
sent, and as the clients saw it), the coordinator's CPU share (25% target) and the crash
detection latency (worst of the run's crashes; 100 ms target). Writes
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
CPU_TARGET = 0.25  # the bound on the service's CPU share at the largest N
DETECT_TARGET_S = 0.100  # the bound on seeing a crash, under load
SERVICE = {"coordinator_service_before": ("before: fixed heartbeats", "#0072B2"),
           "coordinator_service": ("now", "#D55E00"),
           "coordinator_service_step2s": ("now, 2 s steps", "#009E73")}
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
    service = {label: (json.loads(p.read_text())["rows"], colour) for stem, (label, colour) in SERVICE.items()
               if (p := Path(results) / f"{stem}.json").exists()}
    theme()
    if service:
        fig, grid = plt.subplots(2, 3, figsize=(15, 8))
        axes, lower = grid[0][:2], grid[1]
        grid[0][1].sharey(grid[0][0])
        _service_rate(grid[0][2], service)
    else:
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
        ax.set(title=f"state machine: {title}", xlabel="replicas R (8 microbatches each)", ylabel="seconds")
    axes[0].legend(fontsize=7)
    if service:
        _service_row(lower, service)
        fig.subplots_adjust(hspace=0.35, wspace=0.25)
    fig.suptitle("coordinator cost against R (core.coordinator.protocol.ProtocolStateMachine in process"
                 + ("; below: core.coordinator.service.CoordinatorService over loopback)" if service else ")"))
    return save(fig, out, name)


def _service_rate(ax, service: dict) -> None:
    for label, (rows, colour) in service.items():
        N = [r["replicas"] for r in rows]
        ax.plot(N, [r["heartbeats_per_s"] for r in rows], "o-", color=colour, label=f"{label}: heartbeats")
        ax.plot(N, [r["messages_per_s"] for r in rows], "s--", color=colour, alpha=0.6, label=f"{label}: all lines")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(title="service: lines handled per second (steady)", xlabel="replicas N (real connections)",
           ylabel="per second")
    ax.legend(fontsize=7)


def _service_row(axes, service: dict) -> None:
    """Step latency, CPU share and crash detection of the real service, against N."""
    lat, cpu, det = axes
    for label, (rows, colour) in service.items():
        N = [r["replicas"] for r in rows]
        lat.plot(N, [r["step_latency_s"] for r in rows], "o-", color=colour, label=f"{label}: last vote -> commits out")
        lat.plot(N, [r["client_step_latency_s"] for r in rows], "s--", color=colour, alpha=0.6,
                 label=f"{label}: as the clients saw it")
        cpu.plot(N, [r["cpu_share"] for r in rows], "o-", color=colour, label=label)
        det.plot(N, [max(r["crash_detect_s"]) for r in rows], "o-", color=colour, label=f"{label}: crash seen (worst)")
        det.plot(N, [max(r["crash_abort_all_s"]) for r in rows], "s--", color=colour, alpha=0.6,
                 label=f"{label}: abort at the last survivor (worst)")
    lat.axhline(TARGET_S, color="black", lw=0.8, ls=":", label="50 ms")
    cpu.axhline(CPU_TARGET, color="black", lw=0.8, ls=":", label="25% of a core")
    det.axhline(DETECT_TARGET_S, color="black", lw=0.8, ls=":", label="100 ms")
    for ax, title, unit in ((lat, "service: one step's commit", "seconds"),
                            (cpu, "service: coordinator CPU share (steady)", "CPU seconds / wall seconds"),
                            (det, "service: a crash under load", "seconds after the close")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(title=title, xlabel="replicas N (real connections)", ylabel=unit)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(ROOT / "results" / "bench"), help="folder holding the bench JSON")
    ap.add_argument("--out", default=str(HERE), help="folder for the PNG and PDF")
    a = ap.parse_args()
    main(a.results, a.out)
