"""The sweeps behind the simulator's figures: cluster size, and what paper-512's ratio rests on.

Contract:
- `scale_sweep` runs the Llama-3-rate cluster scenario at every size of SCALE_SIZES
  (512 .. 100k GPUs) and returns one row per (size, seed, system).
- `sensitivity` runs paper-512 (recover and its comparator only, ckpt-restart-async; the
  restart x save grid the blocking ckpt-restart, whose stall is the swept save) over restart time x
  checkpoint interval and over the loss unit (GPUs per replica), and finds the
  restart time at which the ratio equals the paper's (`restart_matching_ratio`).
Rows are plain dicts for report.write_rows.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .report import summarize
from .scenario_runner import run_scenario
from .named_scenarios import PAPER, cluster_scenario, paper_512

SCALE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000)


def scale_sweep(seed: int = 0, days: float = 30.0, sizes=SCALE_SIZES, seeds: int = 1) -> list[dict[str, Any]]:
    """Effective throughput and ETTR per system against cluster size (Llama 3 rate, 30 days)."""
    rows = []
    for n in sizes:
        for s in range(seed, seed + seeds):
            res = run_scenario(cluster_scenario(f"scale-{n}", n, days, s, f"{n} GPUs"))
            summ = summarize(res)
            for name, d in summ["systems"].items():
                rows.append({"gpus": n, "seed": s, "system": name,
                             "effective_throughput_vs_failure_free": d["effective_throughput_vs_failure_free"],
                             "goodput_vs_failure_free": d["goodput_vs_failure_free"],
                             "effective_tokens_per_gpu_hour": d["effective_tokens_per_gpu_hour"],
                             "ettr": d["ettr"], "failures": d["failures"],
                             "restart_seconds": res.scenario.calibration.costs.restart_seconds,
                             "interval_iterations": res.checkpoint["interval_iterations"]})
    return rows


SENS_RESTARTS = (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
SENS_INTERVALS = ("young-daly", 2, 4, 8, 16, 32, 64, 128)
SENS_UNITS = (8, 16, 32, 64, 128)
SENS_SAVES = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0)
"""Checkpoint stall per save (s): a blocking save's whole length, or an async save's snapshot."""


def sensitivity(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """paper-512's recover/ckpt-restart ratios against restart time x interval, the loss unit, and
    restart time x checkpoint stall (load = 2 x save, Young/Daly interval for each)."""
    grid = []
    for rs in SENS_RESTARTS:
        for k in SENS_INTERVALS:
            sc = paper_512(seed, restart=rs, checkpoint_every=k)
            sc = replace(sc, systems=("recover", sc.comparator))
            res = run_scenario(sc)
            r = summarize(res)["ratio_recover_over_ckpt_restart"]
            grid.append({"restart_seconds": rs, "checkpoint_every": str(k),
                         "interval_iterations": res.checkpoint["interval_iterations"],
                         "interval_seconds": res.checkpoint["interval_iterations"] * res.checkpoint["iteration_seconds"],
                         "ratio_effective_throughput": r["effective_throughput"],
                         "ratio_last_quarter": r["effective_throughput_last_quarter"],
                         "more_tokens_percent_at_234": r.get("more_tokens_percent_at_gpu_hour_mark")})
    units = []
    for g in SENS_UNITS:
        sc = paper_512(seed, gpus_per_replica=g)
        sc = replace(sc, systems=("recover", sc.comparator))
        res = run_scenario(sc)
        r = summarize(res)["ratio_recover_over_ckpt_restart"]
        units.append({"gpus_per_replica": g, "losses": 256 // g, "ratio_effective_throughput": r["effective_throughput"],
                      "ratio_last_quarter": r["effective_throughput_last_quarter"],
                      "more_tokens_percent_at_234": r.get("more_tokens_percent_at_gpu_hour_mark")})
    saves = []
    for rs in SENS_RESTARTS:
        for sv in SENS_SAVES:
            sc = paper_512(seed, restart=rs)
            cal = sc.calibration
            costs = replace(cal.costs, checkpoint_save_seconds=sv, checkpoint_load_seconds=2 * sv,
                            checkpoint_async_stall_seconds=None)  # the stall is the swept save
            # the blocking ckpt-restart: its stall per save is the swept one, whatever saves it
            sc = replace(sc, systems=("recover", "ckpt-restart"), comparator="ckpt-restart",
                         calibration=replace(cal, costs=costs))
            res = run_scenario(sc)
            r = summarize(res)["ratio_recover_over_ckpt_restart"]
            saves.append({"restart_seconds": rs, "save_stall_seconds": sv, "load_seconds": 2 * sv,
                          "interval_iterations": res.checkpoint["interval_iterations"],
                          "ratio_effective_throughput": r["effective_throughput"],
                          "more_tokens_percent_at_234": r.get("more_tokens_percent_at_gpu_hour_mark")})
    return {"restart_x_interval": grid, "loss_unit": units, "restart_x_save": saves,
            "paper_range": paper_range(saves),
            "restart_matching_paper": restart_matching_ratio(PAPER["effective_throughput_ratio"], seed)}


def paper_range(rows: list[dict[str, Any]], tolerance: float = 0.10) -> dict[str, Any]:
    """Which (restart, save stall) points of the restart x save grid give the paper's 2.23x, its +74.9%
    at 234 GPU-hours, or both, each within `tolerance` (relative)."""
    def near(v, target):
        return v is not None and abs(v / target - 1) <= tolerance
    ratio = [r for r in rows if near(r["ratio_effective_throughput"], PAPER["effective_throughput_ratio"])]
    tokens = [r for r in rows if near(r["more_tokens_percent_at_234"], PAPER["more_tokens_percent_at_gpu_hours"])]
    both = [r for r in ratio if r in tokens]
    pick = lambda rs: [{"restart_seconds": r["restart_seconds"], "save_stall_seconds": r["save_stall_seconds"],  # noqa: E731
                        "ratio": r["ratio_effective_throughput"], "more_tokens_percent": r["more_tokens_percent_at_234"]}
                       for r in rs]
    return {"tolerance": tolerance, "paper": PAPER, "ratio_matches": pick(ratio), "tokens_matches": pick(tokens),
            "both_match": pick(both)}


def restart_matching_ratio(target: float, seed: int = 0) -> dict[str, Any]:
    """The ckpt-restart restart time at which paper-512 gives `target` (bisection, Young/Daly interval)."""
    def ratio(rs: float) -> float:
        sc = paper_512(seed, restart=rs)
        sc = replace(sc, systems=("recover", sc.comparator))
        return summarize(run_scenario(sc))["ratio_recover_over_ckpt_restart"]["effective_throughput"]
    lo, hi = 0.0, 2000.0
    if not ratio(lo) <= target <= ratio(hi):
        return {"target": target, "restart_seconds": None, "note": "target outside the ratio's range over 0-2000 s"}
    for _ in range(40):
        mid = (lo + hi) / 2
        if ratio(mid) < target:
            lo = mid
        else:
            hi = mid
    return {"target": target, "restart_seconds": (lo + hi) / 2}
