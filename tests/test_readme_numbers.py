"""The README's simulator headline numbers agree with the committed results they come from.

Each number is found in README.md by the sentence around it and compared, at the precision
the README prints, with the results/sim (or results/bench-derived) value it reports, so a
regenerated result that moves a headline fails here until the README is regenerated too.
Pure file reads plus one calibration call (no simulation, no processes).
"""
from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The README and the pages of docs/ it links (its numbers moved there with their sections):
# a number is found wherever the documentation prints it.
README = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
SIM = ROOT / "results" / "sim"


def summary(name: str) -> dict:
    return json.loads((SIM / name / "summary.json").read_text())


def found(pattern: str) -> tuple[str, ...]:
    m = re.search(pattern, README)
    assert m, f"README.md lost the sentence matching {pattern!r}"
    return m.groups()


def same(printed: str, value: float) -> None:
    """`printed` is `value` rounded to the digits the README shows."""
    digits = len(printed.split(".")[1]) if "." in printed else 0
    assert float(printed) == pytest.approx(round(value, digits), abs=0.51 * 10 ** -digits), (printed, value)


def test_scenario_table_matches_results():
    p5 = summary("paper-512")["ratio_recover_over_ckpt_restart"]
    whole, last, more, blocking = found(r"\| `paper-512`[^|]*\| ([\d.]+)x whole run, ([\d.]+)x in its last quarter; "
                                        r"\+([\d.]+)% tokens at 234 GPU-h \(blocking: ([\d.]+)x\)")
    assert summary("paper-512")["comparator"] == "ckpt-restart-async"
    same(blocking, summary("paper-512")["ratio_recover_over"]["ckpt-restart"]["effective_throughput"])
    same(whole, p5["effective_throughput"])
    same(last, p5["effective_throughput_last_quarter"])
    same(more, p5["more_tokens_percent_at_gpu_hour_mark"])
    l16 = summary("llama3-16k")
    ratio, blocking, ettr = found(r"\| `llama3-16k`[^|]*\| ([\d.]+)x \(blocking: ([\d.]+)x\) \| "
                                  r"ckpt-restart-async's ETTR ([\d.]+)")
    same(ratio, l16["ratio_recover_over_ckpt_restart"]["effective_throughput"])
    same(blocking, l16["ratio_recover_over"]["ckpt-restart"]["effective_throughput"])
    same(ettr, l16["systems"][l16["comparator"]]["ettr"])
    k = summary("100k")
    ratio, blocking, ck, rec, ft_good, ft_ettr = found(
        r"\| `100k`[^|]*\| ([\d.]+)x \(blocking: ([\d.]+)x\) \| ckpt-restart-async's ETTR ([\d.]+), recover's "
        r"([\d.]+); torchft's goodput is ([\d.]+)x recover's, its ETTR ([\d.]+)")
    s = k["systems"]
    same(ratio, k["ratio_recover_over_ckpt_restart"]["effective_throughput"])
    same(blocking, k["ratio_recover_over"]["ckpt-restart"]["effective_throughput"])
    same(ck, s[k["comparator"]]["ettr"])
    same(rec, s["recover"]["ettr"])
    same(ft_good, s["torchft"]["goodput_tokens_per_s"] / s["recover"]["goodput_tokens_per_s"])
    same(ft_ettr, s["torchft"]["ettr"])


def test_sensitivity_and_restart_law_match_results():
    from recover.experiments.sim.calibration import restart_law

    law = restart_law(ROOT / "results" / "bench")
    anchor, exponent, at512 = found(r"(?s)load: ([\d.]+) s on\s+4 processes\).*?exponent of\s+"
                                    r"([\d.]+)\s+and\s+([\d.]+) s at 512 GPUs")
    same(anchor, law.small_seconds)
    same(exponent, law.exponent)
    same(at512, law(512))
    match = json.loads((SIM / "sensitivity" / "restart_matching_paper.json").read_text())
    (restart,) = found(r"the ratio is 2\.23x at a ([\d.]+) s restart")
    same(restart, match["restart_seconds"])
    units = [float(r["ratio_effective_throughput"]) for r in csv.DictReader(open(SIM / "sensitivity" / "loss_unit.csv"))]
    lo, hi = found(r"([\d.]+)-([\d.]+)x over the loss unit")
    same(lo, min(units))
    same(hi, max(units))


def test_paper_range_sentence_matches_results():
    """Every (restart, save) point the sensitivity sweep finds near the paper's numbers is named in the
    README with its ratio and token gain, and 'no point gives both' only when none does."""
    d = json.loads((SIM / "sensitivity" / "paper_range.json").read_text())
    assert d["ratio_matches"], "the sweep should bracket the paper's 2.23x"
    for r in d["ratio_matches"] + d["tokens_matches"]:
        ratio, more = found(rf"{r['restart_seconds']:g} s restart with a {r['save_stall_seconds']:g} s save "
                            r"\(([\d.]+)x, \+([\d.]+)%\)")
        same(ratio, r["ratio"])
        same(more, r["more_tokens_percent"])
    assert ("no point gives both" in README) == (not d["both_match"])


def test_fast_baseline_range_matches_results():
    rows = [r for r in csv.DictReader(open(SIM / "sensitivity" / "restart_x_save.csv"))
            if float(r["restart_seconds"]) <= 40 and float(r["save_stall_seconds"]) <= 1.0]
    lo, hi = found(r"restarts up to 40 s with a\s+0\.5-1 s stall give ([\d.]+)-([\d.]+)x")
    ratios = [float(r["ratio_effective_throughput"]) for r in rows]
    same(lo, min(ratios))
    same(hi, max(ratios))


def test_digest_cost_matches_its_benchmark():
    rows = {r["model"]: r for r in json.loads((ROOT / "results" / "bench" / "digest.json").read_text())["models"]}
    tiny, small, tiny_sha, small_sha = found(
        r"ratios of medians in one process\): ([\d.]+)% of an iteration on `tiny`,\s+([\d.]+)% on `small` "
        r"\(the plain sha256 of every byte: ([\d.]+)% and ([\d.]+)%\)")
    same(tiny, 100 * rows["tiny"]["fingerprint_over_iteration"])
    same(small, 100 * rows["small"]["fingerprint_over_iteration"])
    same(tiny_sha, 100 * rows["tiny"]["sha256_over_iteration"])
    same(small_sha, 100 * rows["small"]["sha256_over_iteration"])


def test_state_transfer_ratios_match_the_committed_benchmark():
    rows = {r["model"]: r for r in json.loads((ROOT / "results" / "bench" / "state_transfer.json").read_text())["rows"]}
    tiny, small, gpt2 = found(r"throughput\s+([\d.]+) of a plain gloo broadcast of the same bytes on\s+`tiny` "
                              r"\(1\.4 MB\) and ([\d.]+) on `small` \(10 MB\), and ([\d.]+) on `gpt2-124m`")
    same(tiny, rows["tiny"]["throughput_ratio"])
    same(small, rows["small"]["throughput_ratio"])
    same(gpt2, rows["gpt2-124m"]["throughput_ratio"])
    tiny_t, tiny_b, small_t, small_b = found(
        r"the broadcast: ([\d.]+) ms against ([\d.]+) ms on tiny, ([\d.]+) ms against ([\d.]+) ms on small")
    same(tiny_t, 1e3 * rows["tiny"]["transfer_median_s"])
    same(tiny_b, 1e3 * rows["tiny"]["broadcast_median_s"])
    same(small_t, 1e3 * rows["small"]["transfer_median_s"])
    same(small_b, 1e3 * rows["small"]["broadcast_median_s"])


def test_coordinator_numbers_match_the_service_bench():
    """The coordinator paragraph: the fit to results/bench/coordinator_service.json, the 100k
    scenario's share and the largest R below 1%, and the N = 4,096 table rows."""
    from recover.experiments.sim.calibration import coordinator_law
    from recover.experiments.sim.named_scenarios import SCENARIOS

    law = coordinator_law()
    slope, share, it, rmax = found(r"The fit gives ([\d.]+) us per replica, so the `100k` scenario's\s+781 replicas "
                                   r"of 128 GPUs pay ([\d.]+)% of its ([\d.]+) s iteration, and the single\s+coordinator "
                                   r"stays below 1% of such an iteration up to R = ([\d,]+) replicas")
    job = SCENARIOS["100k"]().calibration.job
    t_it = job.iteration_seconds(job.replicas)
    assert job.replicas == 781
    same(slope, law.per_replica_seconds * 1e6)
    same(share, 100 * law(job.replicas) / t_it)
    same(it, t_it)
    assert int(rmax.replace(",", "")) == law.largest_replicas(t_it)
    assert law(law.largest_replicas(t_it)) <= 0.01 * t_it < law(law.largest_replicas(t_it) + 1)
    bench = ROOT / "results" / "bench"
    for stem in ("coordinator_service_before", "coordinator_service", "coordinator_service_step2s"):
        (row,) = [r for r in json.loads((bench / f"{stem}.json").read_text())["rows"] if r["replicas"] == 4096]
        hb, cpu, crash, abort, freeze = found(
            rf"\(`{stem}.json`\) \| (\d+)/s \| ([\d.]+)% of a core \| ([\d.]+) ms \| (\d+) ms \| ([\d.]+) s \|")
        same(hb, row["heartbeats_per_s"])
        same(cpu, 100 * row["cpu_share"])
        same(crash, 1e3 * max(row["crash_detect_s"]))
        same(abort, 1e3 * max(row["crash_abort_all_s"]))
        same(freeze, max(row["freeze_detect_s"]))


def test_checkpoint_stall_matches_results():
    bench = json.loads((ROOT / "results" / "bench" / "checkpoint_stall.json").read_text())["models"]
    tiny, small = found(r"stalls ([\d.]+) of an iteration on `tiny` and ([\d.]+) on `small`")
    same(tiny, bench["tiny"]["stall_per_iteration"])
    same(small, bench["small"]["stall_per_iteration"])
    tiny, small = found(r"runs takes ([\d.]+)x \(tiny\) and ([\d.]+)x \(small\) one without")
    same(tiny, bench["tiny"]["iteration_with_save_ratio"])
    same(small, bench["small"]["iteration_with_save_ratio"])


def test_coordinator_restart_numbers_match_the_committed_bench():
    bench = json.loads((ROOT / "results" / "bench" / "coordinator_restart.json").read_text())["median_seconds"]
    replica, crash, commit, hang = found(
        r"a replica crash ([\d.]+) s, a coordinator crash ([\d.]+) s\nmid-iteration and ([\d.]+) s mid-commit, "
        r"a frozen coordinator ([\d.]+) s")
    for printed, name in ((replica, "replica_crash"), (crash, "coordinator_crash"), (commit, "mid_commit"),
                          (hang, "coordinator_hang")):
        same(printed, bench[name])


def _bench(*parts: str) -> dict:
    return json.loads(ROOT.joinpath("results", "bench", *parts).read_text())


def _ratio(rows: dict, model: str, layout: str, tree: str) -> float:
    return next(r["recover_over_plain"] for r in rows["ratios"]
                if (r["model"], r["layout"], r["tree"]) == (model, layout, tree))


def test_readiness_cost_matches_its_benchmarks():
    tiny, both = _bench("iteration_readiness_tiny.json"), _bench("iteration_readiness.json")
    tb, ta, sb, sa = found(r"recover / plain ([\d.]+) before, ([\d.]+) after on `tiny`[\s\S]*?"
                           r"\(~165 ms a step,\s+results/bench/iteration_readiness.json, 3 rounds\) ([\d.]+) before, "
                           r"([\d.]+) after")
    same(tb, _ratio(tiny, "tiny", "4x1", "baseline"))
    same(ta, _ratio(tiny, "tiny", "4x1", "this"))
    same(sb, _ratio(both, "small", "4x1", "baseline"))
    same(sa, _ratio(both, "small", "4x1", "this"))
    after, before = found(r"kill -> next commit p50 (\d+) ms after, (\d+) ms before")
    same(after, 1000 * _bench("readiness", "after", "recovery_recover.json")["kill_to_next_commit_s"]["p50"])
    same(before, 1000 * _bench("readiness", "before", "recovery_recover.json")["kill_to_next_commit_s"]["p50"])


def test_hsdp_numbers_match_their_benchmarks():
    s2, s1 = _bench("hsdp", "recovery_recover_s2.json"), _bench("hsdp", "recovery_recover.json")
    k2, it2, r2, k1, it1, r1 = found(r"kill -> next commit p50 (\d+) ms for 3 x 2 HSDP \(its failure-free iteration "
                                     r"(\d+) ms: ([\d.]+)\s+of one\) against (\d+) ms for 3 x 1 data parallel "
                                     r"\(iteration (\d+) ms: ([\d.]+) of one\)")
    for printed_k, printed_it, printed_r, s in ((k2, it2, r2, s2), (k1, it1, r1, s1)):
        k, it = s["kill_to_next_commit_s"]["p50"], s["failure_free_iteration_s"]["recover"]
        same(printed_k, 1000 * k)
        same(printed_it, 1000 * it)
        same(printed_r, k / it)
    hsdp = _bench("iteration_hsdp.json")
    a, b = found(r"\(results/bench/iteration_hsdp.json\):\s+([\d.]+) at 3 x 2 and ([\d.]+) at 3 x 1")
    same(a, _ratio(hsdp, "tiny", "3x2", "this"))
    same(b, _ratio(hsdp, "tiny", "3x1", "this"))


def test_local_throughput_numbers_match_the_aggregated_summary():
    """The throughput experiment's paragraph: both metrics, per label, from results/throughput_summary.csv
    (mean over seeds, as aggregate.headline gives them)."""
    from recover.experiments.aggregate import headline

    rows = list(csv.DictReader(open(ROOT / "results" / "throughput_summary.csv")))
    h = headline(rows)
    per_s, per_h = found(r"recover over checkpoint-restart \*\*([\d.]+)x per wall second, ([\d.]+)x per process-hour\*\*")
    same(per_s, h["recover_over_ckpt_restart"]["effective_tokens_per_s"])
    same(per_h, h["recover_over_ckpt_restart"]["effective_tokens_per_process_hour"])
    eff = found(r"\(recover ([\d,]+) effective tokens/s, checkpoint-restart ([\d,]+), elastic keep-global\s+([\d,]+), "
                r"torchft ([\d,]+), elastic keep-per-replica ([\d,]+), failure-free ([\d,]+)\)")
    labels = ("recover", "ckpt-restart", "elastic-keep-global", "torchft", "elastic-keep-per-replica", "failure-free")
    for printed, label in zip(eff, labels):
        same(printed.replace(",", ""), h[label]["effective_tokens_per_s"])
    ft, rec, epr = found(r"the systems that shrink the batch: torchft ([\d,]+) tokens/s against recover's ([\d,]+),"
                         r"\s+and elastic keep-per-replica ([\d,]+);")
    same(ft.replace(",", ""), h["torchft"]["goodput_tokens_per_s"])
    same(rec.replace(",", ""), h["recover"]["goodput_tokens_per_s"])
    same(epr.replace(",", ""), h["elastic-keep-per-replica"]["goodput_tokens_per_s"])


def _validation_table(caption: str, path: Path, plans: tuple[str, str]) -> dict:
    """The table whose header names `caption`: each system's errors after the first step (two runs,
    pooled) and from the start (two runs), against the validation.json at `path`."""
    v = json.loads(path.read_text())
    runs = {(r["simulated_as"], r["run"].rsplit("_plan_", 1)[-1]): r for r in v["runs"] if r["role"] == "validated"}
    at = README.index(f"| system ({caption}) |")
    table = README[at:README.index("\n\n", at)]
    pct = r"([+-][\d.]+)%"
    a_, b_ = plans
    for system in ("recover", "ckpt-restart", "elastic-keep-global", "torchft"):
        m = re.search(rf"\| {system} \| {pct} \| {pct} \| {pct} \| {pct} \| {pct} \|", table)
        assert m, f"the {caption} validation table lost {system}"
        a, b, pooled, a0, b0 = m.groups()
        same(a, 100 * runs[(system, a_)]["error_after_first_step"])
        same(b, 100 * runs[(system, b_)]["error_after_first_step"])
        same(pooled, 100 * v["pooled_by_system"][system]["error"])
        same(a0, 100 * runs[(system, a_)]["error_from_start"])
        same(b0, 100 * runs[(system, b_)]["error_from_start"])
    assert len(runs) == 8
    return v


def test_validation_table_matches_validation_json():
    """The tiny 20-step runs' table: each system's row, and how many runs are outside 10% from the start."""
    v = _validation_table("tiny, 20 steps", SIM / "validation.json", ("a", "b"))
    outside = sum(abs(r["error_from_start"]) > v["tolerance"] for r in v["runs"] if r["role"] == "validated")
    (n,) = found(r"From the start\s+\(launch included\) (\d+) of 8 runs are outside 10%")
    assert int(n) == outside


def test_small_model_validation_table_matches_its_validation_json():
    """The small model's 80-step runs, every system within 10% run by run after the first
    step, and the count within 10% from the start, as the docs say."""
    v = _validation_table("small, 80 steps", SIM / "validation-small" / "validation.json", ("c", "d"))
    (n,) = found(r"Every run is within 10% after the first step, run by run; from the start (\d) of 8 are")
    assert v["validated"] == v["total"] == 8
    assert int(n) == v["validated_from_start"]


def test_throughput_fault_steps_match_the_committed_runs():
    """The steps at which each seed's replicas are lost, as faults.jsonl of its recover run has them."""
    def steps(seed: int) -> list[int]:
        lines = (ROOT / "results" / "throughput" / f"recover_s{seed}" / "faults.jsonl").read_text().splitlines()
        return sorted(json.loads(x)["step"] for x in lines if x.strip())

    a0, b0, c0, d0, n1, e1, f1 = found(r"seed 0 loses (\d) of 4 replicas at steps (\d+) and (\d+) and a third at "
                                       r"step (\d+);\s+seed 1 loses (\d), at steps (\d+) and (\d+)\)")
    assert int(a0) == 2 and steps(0) == [int(b0), int(c0), int(d0)]
    assert steps(1) == [int(e1), int(f1)] and len(steps(1)) == int(n1)
    (n,) = found(r"Every run of both seeds committed\s+all (\d+) steps")
    rows = list(csv.DictReader(open(ROOT / "results" / "throughput_summary.csv")))
    assert all(r["status"] == "ok" and int(r["steps"]) == int(n) for r in rows) and {r["seed"] for r in rows} == {"0", "1"}


def test_recovery_hang_rows_at_one_detection_bound_match_the_summary():
    rows = {r["run"]: r for r in csv.DictReader(open(ROOT / "results" / "recovery_summary.csv"))}
    printed = found(r"recover takes ([\d.]+) / ([\d.]+) / ([\d.]+) s: its hang recovery is its detection setting")
    for p, r in zip(printed, (2, 4, 8)):
        same(p, float(rows[f"recover-hb10s_hang_r{r}_s0"]["recovery_seconds"]))


def test_100k_run_size_matches_its_summary():
    k = summary("100k")
    failures, systems = found(r"100k GPUs x 30 days \(([\d,]+)\s+failures, (\d+) simulated systems and settings\)")
    assert int(failures.replace(",", "")) == k["failures_drawn"] and int(systems) == len(k["systems"])


def test_throughput_from_first_commit_matches_the_aggregated_summary():
    from recover.experiments.aggregate import headline

    h = headline(list(csv.DictReader(open(ROOT / "results" / "throughput_summary.csv"))))
    ff, rec, ck, ratio, spread = found(
        r"(?s)`startup_seconds`: failure-free ([\d.]+) s, recover ([\d.]+) s,\s+checkpoint-restart ([\d.]+) s on average\), "
        r"recover over checkpoint-restart is ([\d.]+)x.*?\s+first commit\); and the two failure-free runs \(one per seed, "
        r"same set-up\) differ ([\d.]+)x")
    same(ff, h["failure-free"]["startup_seconds"])
    same(rec, h["recover"]["startup_seconds"])
    same(ck, h["ckpt-restart"]["startup_seconds"])
    same(ratio, h["recover_over_ckpt_restart"]["effective_tokens_per_s_from_first_commit"])
    same(spread, h["failure-free"]["effective_tokens_per_s_from_first_commit_spread"])
    (as_fast,) = found(r"recover runs as fast as failure-free \(([\d.]+)x per wall\s+second\)")
    same(as_fast, h["recover"]["effective_tokens_per_s"] / h["failure-free"]["effective_tokens_per_s"])


def test_the_readmes_headline_table_is_the_committed_summaries():
    """The README's own headline table (the figures a newcomer reads first)."""
    readme = (ROOT / "README.md").read_text()
    rows = {r["run"]: r for r in csv.DictReader(open(ROOT / "results" / "recovery_summary.csv"))}
    for system, label in (("recover", "recover"), ("torchft", "torchft"), ("ckpt-restart", "checkpoint-restart")):
        m = re.search(rf"{label} ([\d.]+) / ([\d.]+) / ([\d.]+) s", readme)
        assert m, f"the README's headline table lost {label}'s crash recovery"
        for printed, r in zip(m.groups(), (2, 4, 8)):
            same(printed, float(rows[f"{system}_crash_r{r}_s0"]["recovery_seconds"]))
    (p512,) = re.search(r"recover / checkpoint-restart ([\d.]+)x in trajectory-equivalent", readme).groups()
    same(p512, summary("paper-512")["ratio_recover_over_ckpt_restart"]["effective_throughput"])
    traj = [r for r in csv.DictReader(open(ROOT / "results" / "trajectory_summary.csv")) if r["label"] == "recover"]
    (printed,) = re.search(r"largest loss difference ([\d.e-]+): summation order", readme).groups()
    # printed with two significant digits (4.8e-07)
    assert float(printed) == pytest.approx(max(float(r["max_abs_loss_diff"]) for r in traj), rel=0.02)


def test_exact_mode_is_bit_identical_in_the_committed_trajectory_runs():
    """The README's claim for --exact: 0.0 at every step, faults fired, in every seed."""
    rows = [r for r in csv.DictReader(open(ROOT / "results" / "trajectory_summary.csv")) if r["label"] == "recover-exact"]
    assert len(rows) == 3 and all(r["status"] == "ok" and float(r["max_abs_loss_diff"]) == 0.0 and int(r["faults_fired"]) > 0
                                  and r["steps_on_trajectory"] == r["steps"] for r in rows)
    assert "|loss difference\\| 0.0 at every step of 3 seeds" in (ROOT / "README.md").read_text()


def test_recovery_bench_table_matches_the_committed_benches():
    """docs/scale.md's side-by-side: each system's kill -> next commit p50 / p95, kill -> interrupted step
    committed p50, and microbatches lost per kill p50, against results/bench/recovery_<system>.json."""
    for system in ("recover", "torchft", "ckpt-restart", "elastic"):
        b = json.loads((ROOT / "results" / "bench" / f"recovery_{system}.json").read_text())
        kills, p50, p95, progress, lost = found(
            rf"\| {system} \((\d+) kills\) \| ([\d.]+) s / ([\d.]+) s \| ([\d.]+) s \| (\d+) ")
        assert int(kills) == b["kills"]
        same(p50, b["kill_to_next_commit_s"]["p50"])
        same(p95, b["kill_to_next_commit_s"]["p95"])
        same(progress, b["kill_to_progress_s"]["p50"])
        same(lost, b["work_lost_microbatches"]["p50"])


def test_the_headline_recovery_row_quotes_the_recovery_bench():
    readme = (ROOT / "README.md").read_text()
    rec, ck = re.search(r"kill → next commit p50: recover ([\d.]+) s \(\d+ kills\), checkpoint-restart ([\d.]+) s",
                        readme).groups()
    same(rec, _bench("recovery_recover.json")["kill_to_next_commit_s"]["p50"])
    same(ck, _bench("recovery_ckpt-restart.json")["kill_to_next_commit_s"]["p50"])


def test_the_3xS2_sitting_beside_torchft_matches_its_kills():
    """README's headline row and docs/experiments.md's table: kill -> next commit p50 per seed and over
    both seeds' kills, from results/bench/hsdp_vs_torchft/seed<S>/*_kills.csv."""
    folder = ROOT / "results" / "bench" / "hsdp_vs_torchft"
    files = {"recover": "recovery_recover_s2", "torchft (lighthouse 1 s)": "recovery_torchft_s2",
             "torchft (lighthouse 250 ms)": "recovery_torchft_s2_hb250_join250"}
    pooled = {}
    for label, name in files.items():
        per_seed = [[float(r["kill_to_next_commit_s"]) for r in csv.DictReader(open(folder / f"seed{s}" / f"{name}_kills.csv"))]
                    for s in (0, 1)]
        s0, s1, both = found(rf"\| {re.escape(label)} \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+) s")
        same(s0, statistics.median(per_seed[0]))
        same(s1, statistics.median(per_seed[1]))
        same(both, statistics.median(per_seed[0] + per_seed[1]))
        pooled[label] = statistics.median(per_seed[0] + per_seed[1])
    rec, ft, x1, ft250, x250 = found(r"recover ([\d.]+) s, torchft ([\d.]+) s at 1 s \(([\d.]+)x\) and ([\d.]+) s at "
                                     r"250 ms \(([\d.]+)x\)")
    same(rec, pooled["recover"])
    same(ft, pooled["torchft (lighthouse 1 s)"])
    same(ft250, pooled["torchft (lighthouse 250 ms)"])
    same(x1, pooled["torchft (lighthouse 1 s)"] / pooled["recover"])
    same(x250, pooled["torchft (lighthouse 250 ms)"] / pooled["recover"])
