"""The replica layout (core/config/replica_layout.py) and how the simulator's replica size maps onto it.

Pure tests, but for the two CLI ones (marked procs): a layout's validation, its
product, JobModel's check that layout and gpus_per_replica agree, the scenarios'
layouts, and that two layouts of one size simulate to the same numbers.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import run_recover

from recover.core.config.replica_layout import DIMENSIONS, ReplicaLayout
from recover.experiments.sim.model import JobModel
from recover.experiments.sim.report import summarize
from recover.experiments.sim.scenario_runner import run_scenario
from recover.experiments.sim.named_scenarios import (LLAMA3_LAYOUT, PAPER_512_LAYOUT, cluster_100k, llama3_16k,
                                              paper_512, paper_512_job)


# ---- the layout ---------------------------------------------------------------------------
@pytest.mark.parametrize("dim", DIMENSIONS)
@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
def test_a_bad_dimension_is_a_value_error_naming_it(dim, bad):
    with pytest.raises(ValueError, match=f"layout {dim}: must be an integer >= 1"):
        ReplicaLayout(**{dim: bad})


def test_ranks_are_the_product_one_gpu_each():
    lay = ReplicaLayout(shard=2, tp=8, pp=4)
    assert lay.ranks == lay.gpus == 64
    assert ReplicaLayout().ranks == 1 and ReplicaLayout().describe() == "1 rank"
    assert ReplicaLayout(tp=8, pp=4).describe() == "TP 8 x PP 4"
    assert ReplicaLayout(shard=2).describe() == "shard 2"
    assert ReplicaLayout(shard=2).non_trivial() == {"shard": 2}
    assert ReplicaLayout.from_dict({"shard": 2, "replicas": 4}) == ReplicaLayout(shard=2)
    assert ReplicaLayout.from_dict(lay.to_dict()) == lay
    lay.check_size(64)
    with pytest.raises(ValueError, match="= 64 ranks, but the replica has 32 GPUs"):
        lay.check_size(32)


# ---- the simulator's replica size --------------------------------------------------------------
def test_job_model_takes_its_replica_size_from_the_layout():
    job = JobModel.of_layout(ReplicaLayout(tp=8, pp=4), n_gpus=512, microbatches=256)
    assert job.gpus_per_replica == 32 and job.replicas == 16 and job.layout == ReplicaLayout(tp=8, pp=4)
    # a job given both checks that they agree
    with pytest.raises(ValueError, match="= 32 ranks, but the replica has 8 GPUs"):
        JobModel(n_gpus=512, gpus_per_replica=8, microbatches=256, layout=ReplicaLayout(tp=8, pp=4))
    with pytest.raises(ValueError, match="= 2 ranks, but the replica has 4 GPUs"):
        JobModel.of_layout(ReplicaLayout(shard=2), gpus_per_replica=4, n_gpus=8, microbatches=8)
    with pytest.raises(ValueError, match="layout must be a ReplicaLayout"):
        JobModel(n_gpus=8, gpus_per_replica=2, microbatches=8, layout={"shard": 2})
    # a replica's size can change only with its layout
    with pytest.raises(ValueError):
        replace(job, gpus_per_replica=16)
    # a bare size is still a job, whose layout is unknown
    assert JobModel(n_gpus=64, gpus_per_replica=8, microbatches=64).layout is None


def test_the_scenarios_say_their_layouts():
    sc = paper_512()
    job = sc.calibration.job
    assert job.layout == PAPER_512_LAYOUT == ReplicaLayout(tp=8, pp=4) and job.gpus_per_replica == 32
    assert sc.calibration.sources["gpus_per_replica"].startswith("assumed: TP 8 x PP 4 = 32 GPUs per model copy")
    for build in (llama3_16k, cluster_100k):
        j = build().calibration.job
        assert j.layout == LLAMA3_LAYOUT == ReplicaLayout(tp=8, pp=16) and j.gpus_per_replica == 128
    # the layout is not a calibration value: summary.json's table is unchanged by it
    assert "layout" not in {r["name"] for r in sc.calibration.table()}


def test_same_replica_size_simulates_the_same():
    base = summarize(run_scenario(paper_512()))
    for lay in (ReplicaLayout(shard=32), ReplicaLayout(shard=4, tp=8), ReplicaLayout(tp=2, pp=16)):
        other = summarize(run_scenario(paper_512(layout=lay)))
        assert other["systems"] == base["systems"], lay
        assert other["ratio_recover_over_ckpt_restart"] == base["ratio_recover_over_ckpt_restart"]
    # another size is another job: M follows the replicas (16 microbatches each), and so do the losses
    small = paper_512(layout=ReplicaLayout(shard=8))
    assert small.calibration.job.replicas == 64 and small.calibration.job.microbatches == 16 * 64
    assert small.failures.k_lost == 32
    # the sensitivity sweep's bare size is the same job as a layout of that size
    bare, _ = paper_512_job(gpus_per_replica=8)
    assert replace(small.calibration.job, layout=None) == bare


def test_a_layout_the_scenario_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="must be 1 to 256 GPUs"):
        paper_512(layout=ReplicaLayout(tp=8, pp=64))
    with pytest.raises(ValueError, match="layout or its size, not both"):
        paper_512(layout=ReplicaLayout(shard=8), gpus_per_replica=8)


@pytest.mark.procs
def test_simulate_takes_the_layout_flags(tmp_path):
    out = tmp_path / "p512"
    run_recover("simulate", "paper-512", "--shard", "4", "--tp", "8", "--systems", "recover,ckpt-restart",
                "--out", str(out), check=True)
    s = json.loads((out / "summary.json").read_text())
    src = {r["name"]: r for r in s["calibration"]["values"]}["gpus_per_replica"]
    assert src["value"] == 32 and src["source"].startswith("the layout given: shard 4 x TP 8 = 32 GPUs")
    ref = summarize(run_scenario(replace(paper_512(), systems=("recover", "ckpt-restart"))))
    assert json.loads(json.dumps(ref["systems"])) == s["systems"]


@pytest.mark.procs
@pytest.mark.parametrize("argv, flag", [
    (["simulate", "local", "--shard", "2"], "--shard"),
    (["simulate", "scale", "--tp", "2"], "--tp"),
    (["simulate", "paper-512", "--pp", "0"], "--pp"),
    (["simulate", "paper-512", "--tp", "8", "--pp", "64"], "--tp/--pp"),
])
def test_bad_layout_flags_fail_with_one_line(argv, flag):
    proc = run_recover(*argv)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"recover: error: {flag}:") and len(proc.stderr.strip().splitlines()) == 1


def test_validation_leaves_replicas_of_many_ranks_out_with_a_reason(tmp_path):
    from test_sim_cli import write_fixture_run

    from recover.experiments.sim.validation import compare

    write_fixture_run(tmp_path / "one", "recover", [12.0, 12.06, 12.12], [True] * 3)
    write_fixture_run(tmp_path / "hsdp", "recover", [12.0, 12.06, 12.12], [True] * 3)
    cfg = json.loads((tmp_path / "hsdp" / "config.json").read_text())
    cfg["train"]["shard"] = 2
    (tmp_path / "hsdp" / "config.json").write_text(json.dumps(cfg))
    v = compare([tmp_path / "one", tmp_path / "hsdp"], tmp_path / "no-bench")
    assert [r["run"] for r in v["runs"]] == [str(tmp_path / "one")]
    assert v["not_simulated"] == [{"run": str(tmp_path / "hsdp"), "system": "recover", "shard": 2,
                                   "reason": v["not_simulated"][0]["reason"]}]
    assert "replicas of one process" in v["not_simulated"][0]["reason"]
    # without such runs the key is not there: validation.json reads as before
    assert "not_simulated" not in compare([tmp_path / "one"], tmp_path / "no-bench")
