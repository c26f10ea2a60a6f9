"""`recover simulate`, the validation against real runs (on fixture runs), the bench loader, the sim figures.

Real runs of every system do not all exist yet, so the validation code is tested on
small fixture runs written in the results contract (config.json, metrics.jsonl,
summary.json, fault_plan.json), with hand-computed expectations.
"""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
from conftest import run_recover

from recover.experiments.sim.calibration import _redo_mean, local_calibration
from recover.experiments.sim.measured import local_measured
from recover.experiments.sim.scenario_runner import run_scenario
from recover.experiments.sim.named_scenarios import SCENARIOS
from recover.experiments.sim.validation import compare, find_runs, load_run, measure

FIGS = Path(__file__).resolve().parent.parent / "paper_figs"


@pytest.mark.procs
def test_simulate_paper_512_writes_summary_and_timeseries(tmp_path):
    out = tmp_path / "p512"
    proc = run_recover("simulate", "paper-512", "--out", str(out), check=True)
    assert "recover / ckpt-restart" in proc.stdout and "paper: 2.23x" in proc.stdout
    s = json.loads((out / "summary.json").read_text())
    assert set(s["systems"]) == {"recover", "ckpt-restart", "ckpt-restart-async", "elastic-keep-global",
                                 "elastic-keep-per-replica", "torchft", "elastic-keep-global-lastcall30s", "torchft-hb5s"}
    # the headline is against the async-saving baseline; the blocking default is reported beside it
    assert s["comparator"] == "ckpt-restart-async" and "recover / ckpt-restart-async" in proc.stdout
    assert set(s["ratio_recover_over"]) >= {"ckpt-restart", "ckpt-restart-async"}
    assert s["ratio_recover_over"]["ckpt-restart-async"] == s["ratio_recover_over_ckpt_restart"]
    # the upstream defaults never do better than the tuned settings against the same failures
    sy = s["systems"]
    assert sy["torchft-hb5s"]["goodput_tokens_per_s"] <= sy["torchft"]["goodput_tokens_per_s"]
    assert (sy["elastic-keep-global-lastcall30s"]["effective_throughput_tokens_per_s"]
            < sy["elastic-keep-global"]["effective_throughput_tokens_per_s"])
    for d in s["systems"].values():
        for key in ("tokens", "effective_throughput_tokens_per_s", "effective_tokens_per_gpu_hour", "ettr"):
            assert d[key] >= 0
    r = s["ratio_recover_over_ckpt_restart"]
    assert r["effective_throughput"] > 1 and r["gpu_hour_mark"] == 234
    assert all(row["source"] for row in s["calibration"]["values"])  # every value says where it comes from
    rows = list(csv.DictReader(open(out / "timeseries.csv")))
    assert {r["system"] for r in rows} == set(s["systems"])
    assert list(rows[0]) == ["system", "t_seconds", "gpu_hours", "tokens", "effective_tokens", "replicas"]


@pytest.mark.procs
@pytest.mark.parametrize("argv, flag", [
    (["simulate", "nowhere"], "SCENARIO"),
    (["simulate", "local", "--steps", "0"], "--steps"),
    (["simulate", "local", "--systems", "recover,bogus"], "--systems"),
    (["simulate", "paper-512", "--plan", "x.json"], "--plan"),
])
def test_bad_flags_fail_with_one_line(argv, flag):
    proc = run_recover(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"recover: error: {flag}")


# ---- validation on fixture runs ---------------------------------------------------------------
def write_fixture_run(d: Path, system: str, wall: list[float], ids_ok: list[bool], plan=None, extra_cfg=None) -> None:
    d.mkdir(parents=True)
    cfg = {"train": {"system": system, "replicas": 4, "microbatches": 8, "steps": len(wall), "batch_size": 4,
                     "block_size": 0, "heartbeat_timeout": 3.0}, "model": {"block_size": 64}, **(extra_cfg or {})}
    (d / "config.json").write_text(json.dumps(cfg))
    with open(d / "metrics.jsonl", "w") as f:
        for step, (t, ok) in enumerate(zip(wall, ids_ok)):
            ids = list(range(step * 8, step * 8 + 8)) if ok else list(range(step * 8, step * 8 + 6))
            f.write(json.dumps({"step": step, "loss": 1.0, "tokens": 256 * len(ids), "microbatch_ids": ids,
                                "generation": 0, "members": [0, 1, 2, 3], "wall_time": t}) + "\n")
    (d / "summary.json").write_text(json.dumps({"status": "ok", "steps": len(wall)}))
    if plan:
        (d / "fault_plan.json").write_text(json.dumps(plan))


def test_measure_counts_only_full_batch_steps(tmp_path):
    write_fixture_run(tmp_path / "r", "torchft", [10.0, 11.0, 12.0, 14.0], [True, True, False, True])
    m = measure(load_run(tmp_path / "r"))
    assert m["steps"] == 4 and m["effective_tokens"] == 3 * 2048
    assert m["from_start"] == 3 * 2048 / 14.0
    assert m["after_first_step"] == 2 * 2048 / (14.0 - 10.0)


def test_compare_recover_fixture_and_find_runs(tmp_path):
    plan = {"faults": [{"kind": "crash", "replica": 3, "step": 2, "phase": "backward"}]}
    # a real run that took exactly what the simulator predicts would have 0 error: build it from the simulation
    from recover.experiments.sim.failures import events_from_plan
    from recover.experiments.sim.system_policies import simulate_one
    cal = local_calibration(tmp_path / "no-bench")
    walls = []
    for n in range(1, 6):
        rec = simulate_one("recover", cal.job, cal.costs, events_from_plan(plan), float("inf"), max_iterations=n)
        walls.append(rec.last_commit_at)
    write_fixture_run(tmp_path / "results" / "exp" / "run0", "recover", walls, [True] * 5, plan)
    write_fixture_run(tmp_path / "results" / "sim" / "ignored", "recover", walls, [True] * 5)
    runs = find_runs(tmp_path / "results")
    assert runs == [tmp_path / "results" / "exp" / "run0"]
    v = compare(runs, tmp_path / "no-bench")
    row = v["runs"][0]
    assert row["simulated_as"] == "recover" and row["faults"] == 1
    assert row["error_after_first_step"] == pytest.approx(0.0, abs=1e-9) and row["within_tolerance"]
    # the same run 20% slower after its first step: the simulation is 20% too fast, outside 10%
    slow = [walls[0] + (t - walls[0]) * 1.2 for t in walls]
    write_fixture_run(tmp_path / "slow", "recover", slow, [True] * 5, plan)
    row = compare([tmp_path / "slow"], tmp_path / "no-bench")["runs"][0]
    assert row["error_after_first_step"] == pytest.approx(0.2) and not row["within_tolerance"]


def test_compare_reads_baseline_settings(tmp_path):
    cfg = {"baseline": {"ckpt_every": 3, "restart_mode": "replace", "replace_wait": 1.0,
                        "elastic_batch": "keep-per-replica"}}
    write_fixture_run(tmp_path / "ck", "ckpt-restart", [12.0, 12.1, 12.2], [True] * 3, extra_cfg=cfg)
    write_fixture_run(tmp_path / "el", "elastic", [12.0, 12.1, 12.2], [True] * 3, extra_cfg=cfg)
    v = compare([tmp_path / "ck", tmp_path / "el"], tmp_path / "no-bench")
    assert [r["simulated_as"] for r in v["runs"]] == ["ckpt-restart", "elastic-keep-per-replica"]
    assert all(not any("ckpt_every" in n for n in r["notes"]) for r in v["runs"])


@pytest.mark.procs
def test_validate_command_writes_validation_json(tmp_path):
    write_fixture_run(tmp_path / "runs" / "a", "recover", [12.0, 12.06, 12.12, 12.18], [True] * 4)
    plan = {"faults": [{"kind": "crash", "replica": 3, "step": 1, "phase": "forward"}]}
    write_fixture_run(tmp_path / "runs" / "b", "recover", [12.0, 12.3, 12.36, 12.42], [True] * 4, plan)
    proc = run_recover("simulate", "validate", "--real", str(tmp_path / "runs"), "--out", str(tmp_path / "o"),
                       "--bench", str(tmp_path / "no-bench"), check=True)
    v = json.loads((tmp_path / "o" / "validation.json").read_text())
    # the failure-free run calibrates the timing and is not counted; the faulted one is validated
    assert [r["role"] for r in v["runs"]] == ["timing reference", "validated"]
    assert v["total"] == 1 and v["tolerance"] == 0.10 and "timing reference" in proc.stdout
    empty = run_recover("simulate", "validate", "--real", str(tmp_path / "o"), "--out", str(tmp_path / "o2"))
    assert empty.returncode == 1 and "nothing to validate" in empty.stderr


# ---- calibration from `recover bench` ----------------------------------------------------------
def test_local_calibration_reads_bench_files(tmp_path):
    default = local_calibration(tmp_path / "none")
    assert default.costs.restart_seconds == local_measured()["restart_seconds"][0]
    b = tmp_path / "bench"
    b.mkdir()
    (b / "recovery_recover.json").write_text(json.dumps({
        "recovery_overhead_s": {"p50": 0.3}, "failure_free_iteration_s": {"recover": 0.06, "plain": 0.055},
        "replicas": 4, "microbatches": 8, "command": "recover bench recovery --kills 20"}))
    (b / "recovery_ckpt-restart.json").write_text(json.dumps({
        "kill_to_next_commit_s": {"p50": 9.0}, "work_lost_microbatches": {"p50": 16}, "microbatches": 8}))
    (b / "calibration.json").write_text(json.dumps({"checkpoint_save_seconds": 0.5, "source": "hand-made"}))
    cal = local_calibration(b)
    assert cal.job.iteration_seconds(4) == pytest.approx(0.06)
    assert cal.costs.checkpoint_save_seconds == 0.5 and cal.sources["checkpoint_save_seconds"].startswith("hand-made")
    # kill-to-commit 9 s minus the committing iteration and the load (the 16 lost microbatches are
    # redone after that commit, so they are not inside it)
    assert cal.costs.restart_seconds == pytest.approx(9.0 - 0.06 - cal.costs.checkpoint_load_seconds)
    stall = cal.costs.recover_detect_seconds + cal.costs.recover_rebuild_seconds
    assert stall == pytest.approx(0.3 - _redo_mean(cal.job))
    assert "recover bench recovery --kills 20" in cal.sources["recover_rebuild_seconds"]


# ---- the figure scripts, on fixture results ----------------------------------------------------
def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, FIGS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.procs  # matplotlib's font manager runs `fc-list` when it builds its cache (a fresh venv)
def test_sim_figure_scripts_write_png_and_pdf(tmp_path):
    # the committed results/sim, which `recover simulate` wrote (the tests above run its scenarios and
    # sweeps): the figures are drawn from what a reader has, every panel included
    res = Path(__file__).resolve().parent.parent / "results" / "sim"
    for name in ("sim_tokens_vs_gpu_hours", "sim_scale", "sim_sensitivity"):
        paths = _script(name).main(str(res), str(tmp_path / "figs"))
        assert [p.suffix for p in paths] == [".png", ".pdf"]
        assert all(p.stat().st_size > 1000 for p in paths)


def test_restart_time_is_calibrated_leave_one_out(tmp_path):
    """Each checkpoint-restart run gets its restart time from the other run's events.jsonl, never its own."""
    plan = {"faults": [{"kind": "crash", "replica": 3, "step": 2, "phase": "forward"}]}
    for name, restart in (("a", 5.0), ("b", 9.0)):
        write_fixture_run(tmp_path / name, "ckpt-restart", [12.0, 12.1, 12.2, 20.0], [True] * 4, plan,
                          extra_cfg={"baseline": {"ckpt_every": 5}})
        (tmp_path / name / "events.jsonl").write_text(json.dumps(
            {"kind": "restart", "restart_seconds": restart, "lost_steps": 2}) + "\n")
    rows = compare([tmp_path / "a", tmp_path / "b"], tmp_path / "no-bench")["runs"]
    assert "restart time" in rows[0]["notes"][-1] and str(tmp_path / "b") in rows[0]["notes"][-1]
    assert str(tmp_path / "a") in rows[1]["notes"][-1]
    # the run calibrated from the slower restarts of the other one takes longer in simulation
    assert rows[0]["sim"]["last_commit_seconds"] > rows[1]["sim"]["last_commit_seconds"]


def test_cluster_scenarios_anchor_on_the_bench_files(tmp_path):
    """The restart law's small anchor is the restart derived from results/bench (not a typed-in number),
    and paper-512 / the cluster scenarios use the bench they are given."""
    from recover.experiments.sim.calibration import restart_law
    from recover.experiments.sim.named_scenarios import SCENARIOS

    b = tmp_path / "bench"
    b.mkdir()
    (b / "recovery_ckpt-restart.json").write_text(json.dumps({
        "kill_to_next_commit_s": {"p50": 30.0}, "work_lost_microbatches": {"p50": 8}, "microbatches": 8}))
    law = restart_law(b)
    assert law.small_seconds == pytest.approx(local_calibration(b).costs.restart_seconds)
    assert law.small_seconds > 25.0 and str(b) in law.source
    assert law(100_000) == pytest.approx(600.0)
    for name in ("paper-512", "llama3-16k", "100k"):
        slow, committed = SCENARIOS[name](bench=b), SCENARIOS[name]()
        assert slow.calibration.costs.restart_seconds == pytest.approx(law(slow.calibration.job.n_gpus))
        # a bigger measured anchor raises every restart below the published 100k-GPU one
        assert slow.calibration.costs.join_seconds > committed.calibration.costs.join_seconds


def test_async_save_stalls_only_for_its_snapshot():
    """ckpt-restart-async (ckpt_async) pays its snapshot stall per save, the blocking ckpt-restart the
    whole save: with the same failures the async one commits more, and each one's Young/Daly interval
    is set by its own stall."""
    from dataclasses import replace

    from recover.experiments.sim.scenario_runner import checkpoint_plan
    from recover.experiments.sim.named_scenarios import paper_512

    sc = replace(paper_512(), systems=("ckpt-restart", "ckpt-restart-async"))
    cal = sc.calibration
    sc = replace(sc, calibration=replace(cal, costs=replace(cal.costs, checkpoint_save_seconds=10.0,
                                                             checkpoint_async_stall_seconds=0.5)))
    sync_plan, async_plan = checkpoint_plan(sc, "ckpt-restart"), checkpoint_plan(sc, "ckpt-restart-async")
    assert (sync_plan["checkpoint_stall_seconds"], async_plan["checkpoint_stall_seconds"]) == (10.0, 0.5)
    assert async_plan["young_seconds"] < sync_plan["young_seconds"]
    res = run_scenario(sc)
    blocking, async_ = res.runs["ckpt-restart"], res.runs["ckpt-restart-async"]
    assert res.checkpoint["by_system"] == {"ckpt-restart": sync_plan["interval_iterations"],
                                           "ckpt-restart-async": async_plan["interval_iterations"]}
    assert blocking.checkpoints > 0 and async_.checkpoints > 0
    assert async_.effective_tokens > blocking.effective_tokens


def test_cluster_checkpoint_cost_scales_measured_dcp_throughput(tmp_path):
    """With checkpoint_dcp.json, paper-512's async stall, blocking save and load are the bytes each GPU
    writes over the measured async-stall, save and load throughputs; without it, the assumed 10 s / 20 s."""
    from recover.experiments.sim.named_scenarios import PAPER_512_STATE_BYTES, paper_512

    b = tmp_path / "bench"
    b.mkdir()
    (b / "checkpoint_dcp.json").write_text(json.dumps({
        "save_s": {"bytes_per_s": 4e8}, "async_stall_s": {"bytes_per_s": 2e9},
        "async_total_s": {"bytes_per_s": 1e8}, "load_s": {"bytes_per_s": 5e8}}))
    c = paper_512(bench=b).calibration
    per_gpu = PAPER_512_STATE_BYTES / c.job.gpus_per_replica
    assert c.costs.checkpoint_async_stall_seconds == pytest.approx(per_gpu / 2e9)
    assert c.costs.checkpoint_save_seconds == pytest.approx(per_gpu / 4e8)
    assert c.costs.checkpoint_load_seconds == pytest.approx(per_gpu / 5e8)
    assert str(b) in c.sources["checkpoint_async_stall_seconds"]
    none = paper_512(bench=tmp_path / "empty").calibration.costs
    assert none.checkpoint_async_stall_seconds is None and none.checkpoint_save_seconds == 10.0


def test_gpt_parameters_counts_what_the_model_holds():
    """The simulator's parameter count (no torch) against the model torch builds, every size, with and without biases."""
    import dataclasses

    from recover.core.components.model import GPT
    from recover.core.config.shapes import MODEL_CONFIGS
    from recover.experiments.sim.measured import TINY_PARAMETERS, gpt_parameters

    for name in ("tiny", "small", "medium"):
        for bias in (False, True):
            shape = dataclasses.replace(MODEL_CONFIGS[name], bias=bias)
            built = sum(p.numel() for p in GPT(shape).parameters())
            assert gpt_parameters(dataclasses.asdict(shape)) == built, (name, bias)
    assert TINY_PARAMETERS == sum(p.numel() for p in GPT(MODEL_CONFIGS["tiny"]).parameters())


def test_compare_times_a_batch_by_its_failure_free_runs_mean_and_scales_a_larger_models_checkpoints(tmp_path):
    small = {"model": {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 256}}
    # two failure-free runs of one batch, before and after its faulty runs: 0.1 s and 0.3 s steps
    write_fixture_run(tmp_path / "b" / "plain_1", "plain", [10.0 + 0.1 * i for i in range(6)], [True] * 6, extra_cfg=small)
    write_fixture_run(tmp_path / "b" / "plain_2", "plain", [14.0 + 0.3 * i for i in range(6)], [True] * 6, extra_cfg=small)
    plan = {"faults": [{"kind": "crash", "replica": 3, "step": 2, "phase": "backward"}]}
    cfg = {**small, "baseline": {"ckpt_every": 2}}
    write_fixture_run(tmp_path / "b" / "ck", "ckpt-restart", [12.0, 12.2, 22.0, 22.2, 22.4, 22.6], [True] * 6, plan,
                      extra_cfg=cfg)
    v = compare(find_runs(tmp_path / "b"), tmp_path / "no-bench")
    rows = {Path(r["run"]).name: r for r in v["runs"]}
    assert rows["plain_1"]["role"] == rows["plain_2"]["role"] == "timing reference"
    ck = rows["ck"]
    assert any(n.startswith("timing from mean of 2 runs") for n in ck["notes"])
    assert any("836,736 parameters" in n for n in ck["notes"])
    assert v["total"] == 1 and "within_tolerance_from_start" in ck
    # the same run recorded as the tiny model: the checkpoint costs are the measured ones, smaller
    tiny = {"baseline": {"ckpt_every": 2}}
    write_fixture_run(tmp_path / "t" / "plain_1", "plain", [10.0 + 0.1 * i for i in range(6)], [True] * 6)
    write_fixture_run(tmp_path / "t" / "plain_2", "plain", [14.0 + 0.3 * i for i in range(6)], [True] * 6)
    write_fixture_run(tmp_path / "t" / "ck", "ckpt-restart", [12.0, 12.2, 22.0, 22.2, 22.4, 22.6], [True] * 6, plan,
                      extra_cfg=tiny)
    t = {Path(r["run"]).name: r for r in compare(find_runs(tmp_path / "t"), tmp_path / "no-bench")["runs"]}["ck"]
    assert not any("parameters" in n for n in t["notes"])
    assert t["sim"]["last_commit_seconds"] < ck["sim"]["last_commit_seconds"]


def test_fit_compute_measures_the_shared_cpu_at_each_replica_count():
    """One replica's step gives the microbatch alone; each other count its own effective CPU slots, which
    the job interpolates; without a 1-replica run there is nothing to fit."""
    from recover.experiments.sim.model import JobModel
    from recover.experiments.sim.validation import fit_compute

    no_allreduce = lambda r: 0.0  # noqa: E731
    # 8 microbatches: 0.32 s alone (0.04 each); 2 replicas at 0.2 s -> 1.6 slots; 4 at 0.25 s -> 1.28
    t, slots = fit_compute({1: 0.32, 2: 0.2, 4: 0.25}, 8, no_allreduce)
    assert t == pytest.approx(0.04) and slots == (pytest.approx((2, 1.6)), pytest.approx((4, 1.28)))
    assert fit_compute({2: 0.2, 4: 0.25}, 8, no_allreduce) is None
    job = JobModel(n_gpus=4, gpus_per_replica=1, microbatches=8, microbatch_seconds=t, grad_bytes=0.0,
                   link_latency=0.0, cpu_slots=2, cpu_slots_at=slots)
    # the job reproduces the measured steps, and interpolates at 3 replicas
    assert job.iteration_seconds(1) == pytest.approx(0.32)
    assert job.iteration_seconds(2) == pytest.approx(0.2)
    assert job.iteration_seconds(4) == pytest.approx(0.25)
    assert job.slots(3) == pytest.approx((1.6 + 1.28) / 2)


def test_restart_samples_take_off_only_the_committing_step_and_the_load(tmp_path):
    """A restart record's restart_seconds runs to the first commit after the restart (the checkpoint's next
    step); the lost steps are redone after it, so they are not taken off."""
    from recover.experiments.sim.realruns import restart_samples

    write_fixture_run(tmp_path / "ck", "ckpt-restart", [12.0, 12.1, 12.2], [True] * 3)
    (tmp_path / "ck" / "events.jsonl").write_text(json.dumps(
        {"kind": "restart", "restart_seconds": 4.0, "work_lost_steps": 15}) + "\n")
    assert restart_samples(load_run(tmp_path / "ck"), 0.2, 0.3) == [pytest.approx(3.5)]
