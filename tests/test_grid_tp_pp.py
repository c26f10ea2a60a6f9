"""Experiment grids with tensor- and pipeline-parallel replicas: a cell carries tp T and
pp P (and the pipeline schedule) to its TrainConfig as it carries shard S, Slurm nodes and fault
plans count every rank of the S x T x P grid, the recovery fault strikes the layout's last rank,
the failure-free reference (plain) runs the same layout, the runs CSVs carry tp and pp, and
`recover experiment --tp/--pp` checks all this before anything starts.

All pure (grid expansion and validation, fixture results) but for the last test, which runs one
tiny trajectory grid of recover with 2 replicas x TP 2 (marked procs).
"""
from __future__ import annotations

import csv
import json
from argparse import Namespace

import pytest
from conftest import assert_every_planned_fault_fired, run_recover, write_aggregation_run

from recover.experiments import grids as E
from recover.experiments.aggregate import REL_TOL, STEP_FIELDS, SUMMARY_FIELDS, aggregate
from recover.experiments.commands.experiment import cmd_experiment
from recover.core.config.replica_layout import ReplicaLayout

LAYOUTS = [  # (shard, tp, pp, pp_schedule): every dimension alone, T x P, S x T and S x P
    (1, 2, 1, None), (1, 1, 2, "afab"), (1, 2, 2, "1f1b"), (2, 2, 1, None), (2, 1, 2, "1f1b"),
]


@pytest.mark.parametrize("name", list(E.EXPERIMENTS))
@pytest.mark.parametrize("shard, tp, pp, schedule", LAYOUTS)
def test_a_recover_grid_carries_tp_and_pp_to_its_config_and_its_faults(name, shard, tp, pp, schedule):
    grid = E.build_grid(name, seeds=[0], systems=["recover"], shard=shard, tp=tp, pp=pp, pp_schedule=schedule)
    layout = ReplicaLayout(shard=shard, tp=tp, pp=pp)
    rec = [r for r in grid.runs if r.system == "recover"]
    assert rec
    for r in rec:
        r.validate()
        assert r.layout() == layout
        cfg = r.train_config("results")
        assert (cfg.shard, cfg.tp, cfg.pp, cfg.ranks_per_replica) == (shard, tp, pp, layout.ranks)
        assert cfg.pp_schedule == (schedule or "1f1b")
        faults = (r.plan or {}).get("faults", [])
        assert faults and all(0 <= f.get("rank", 0) < layout.ranks for f in faults)
        if name == "recovery":
            assert all(f["rank"] == layout.ranks - 1 for f in faults)  # the last rank, behind the leader
        if name == "throughput":
            assert r.plan["generator"]["gpus_per_replica"] == layout.ranks  # a per-GPU rate counts every rank
    refs = [r for r in grid.runs if r.label == "failure-free"]
    if name != "recovery":
        # plain runs every layout recover runs: the reference is the same partition and schedule, no note
        assert refs and all(r.layout() == layout for r in refs)
        assert all(r.train_config("x").pp_schedule == (schedule or "1f1b") for r in refs)
        assert not any("the failure-free reference runs replicas of" in n for n in grid.notes), grid.notes
        same = {(c.batch_size, c.microbatches) for c in (x.train_config("x") for x in grid.runs)}
        assert len(same) == 1  # the same microbatches of the same rows: the same trajectory


def test_tp_and_pp_of_1_are_the_grid_as_before():
    for name in E.EXPERIMENTS:
        plain = E.build_grid(name, seeds=[0])
        ones = E.build_grid(name, seeds=[0], tp=1, pp=1)
        assert [r.to_dict() for r in plain.runs] == [r.to_dict() for r in ones.runs]
        assert plain.notes == ones.notes
        assert all((r.tp, r.pp) == (1, 1) and "pp_schedule" not in r.overrides for r in plain.runs)


def test_a_spec_json_written_before_tp_and_pp_reads_as_one_rank_each():
    spec = next(r for r in E.build_grid("trajectory", seeds=[0], systems=["recover"], shard=2).runs
                if r.system == "recover")
    old = {k: v for k, v in spec.to_dict().items() if k not in ("tp", "pp")}
    back = E.RunSpec.from_dict(json.loads(json.dumps(old)))
    assert (back.tp, back.pp) == (1, 1) and back.layout() == ReplicaLayout(shard=2)
    back.validate()
    new = E.build_grid("trajectory", seeds=[0], systems=["recover"], tp=2, pp=2).runs[1]
    assert E.RunSpec.from_dict(json.loads(json.dumps(new.to_dict()))) == new


def test_slurm_nodes_count_every_rank_of_the_layout():
    grid = E.build_grid("trajectory", seeds=[0], scale="paper-64", systems=["recover"], tp=2, pp=2)
    by = {r.label: r for r in grid.runs}
    assert by["recover"].nodes == 64 * 4 // 8  # 64 replicas x (TP 2 x PP 2) ranks, 8 GPUs a node
    assert by["failure-free"].nodes == 64 * 4 // 8  # the reference runs the same layout


@pytest.mark.parametrize("kw, match", [
    ({"tp": 0}, "layout tp: must be an integer >= 1"),
    ({"pp": 0}, "layout pp: must be an integer >= 1"),
    ({"tp": 3}, r"trajectory/failure-free_s0: --tp: 3 does not divide the model's 2 attention heads"),
    ({"pp": 3}, r"trajectory/failure-free_s0: --pp: 3 stages, but the model has 2 layers"),
    ({"pp": 2, "pp_schedule": "zb"}, r"--pp-schedule: 'zb' is not one of afab, 1f1b"),
])
def test_a_layout_that_does_not_fit_fails_before_anything_starts(kw, match):
    with pytest.raises(ValueError, match=match):
        E.build_grid("trajectory", seeds=[0], systems=["recover"], **kw)


def test_a_grid_asking_baselines_for_pp_names_the_system_and_every_one_runs_tp():
    with pytest.raises(ValueError, match=r"--system: (elastic|torchft|ckpt-restart) runs replicas split by S and TP "
                                         r"only; 4 x PP2 needs recover or plain$"):
        E.build_grid("trajectory", seeds=[0], pp=2)
    assert all(r.tp == 2 for r in E.build_grid("trajectory", seeds=[0], tp=2).runs)


def _cli(**kw) -> Namespace:
    base = dict(name="recovery", executor="local", seeds=[0], scale="local", systems=["recover"], replicas=None,
                steps=None, shard=None, tp=None, pp=None, pp_schedule=None, recovery_replicas=None,
                checkpoint_every=None, replace_after=None, min_replicas=None, nodes=None, gpus_per_node=None,
                tasks_per_node=None, parallel=1,
                dry_run=True)
    return Namespace(**{**base, **kw})


def test_the_cli_dry_run_prints_the_layout_and_checks_flags(capsys):
    assert cmd_experiment(_cli(tp=2, pp=2, pp_schedule="afab")) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  recover")]
    assert lines and all(" S=1 T=2 P=2 " in ln for ln in lines)
    assert cmd_experiment(_cli(tp=0)) == 2
    assert "--tp: must be >= 1, got 0" in capsys.readouterr().err
    # on a GPU scale, --nodes makes replicas of S x T x P ranks out of nodes x GPUs
    assert cmd_experiment(_cli(name="trajectory", scale="paper-64", nodes=3, gpus_per_node=6, tp=2, pp=2)) == 2
    assert "--nodes: 3 x 6 GPUs do not split into replicas of 4 ranks" in capsys.readouterr().err
    assert cmd_experiment(_cli(name="trajectory", scale="paper-64", nodes=2, tp=2, pp=2)) == 0
    assert "R=4 S=1 T=2 P=2" in capsys.readouterr().out


# ---- aggregation --------------------------------------------------------------------------
def test_runs_csvs_carry_tp_and_pp_beside_shard_and_charge_every_rank(tmp_path):
    write_aggregation_run(tmp_path, "ff", "plain")  # written before the layout: no shard, tp or pp
    write_aggregation_run(tmp_path, "grid", "recover", {"shard": 1, "tp": 2, "pp": 3}, faults=(1.5,))
    for fields in (STEP_FIELDS, SUMMARY_FIELDS):
        assert fields.index("tp") == fields.index("shard") + 1 and fields.index("pp") == fields.index("tp") + 1
    p_steps, p_summary, _ = aggregate(tmp_path, "exp")
    steps = list(csv.DictReader(open(p_steps)))
    assert {(r["run"], r["shard"], r["tp"], r["pp"]) for r in steps} == {("ff", "1", "1", "1"), ("grid", "1", "2", "3")}
    s = {r["run"]: r for r in csv.DictReader(open(p_summary))}
    assert (s["grid"]["tp"], s["grid"]["pp"]) == ("2", "3")
    # 2 replicas of 6 ranks until step 1's commit at 2 s, then 1 replica of 6 ranks to the last commit at 4 s
    assert float(s["grid"]["process_hours"]) * 3600 == pytest.approx(6 * (2 * 2 + 2 * 1))
    assert float(s["ff"]["process_hours"]) * 3600 == pytest.approx(4 * 2)


# ---- one tiny real grid -------------------------------------------------------------------
@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_tiny_recover_grid_of_2_replicas_x_tp_2_runs_and_stays_on_the_trajectory(tmp_path):
    args = ["experiment", "trajectory", "--executor", "local", "--seeds", "0", "--systems", "recover",
            "--replicas", "2", "--tp", "2", "--steps", "3", "--out", str(tmp_path / "results"),
            "--logs", str(tmp_path / "logs"), "--folder", str(tmp_path / "submitit")]
    proc = run_recover(*args, timeout=280)
    assert proc.returncode == 0 and "2 ok" in proc.stdout, proc.stdout + proc.stderr
    assert "the failure-free reference runs replicas of" not in proc.stdout  # plain runs TP 2 itself
    runs = tmp_path / "results" / "trajectory"
    assert json.loads((runs / "recover_s0" / "config.json").read_text())["train"]["tp"] == 2
    assert json.loads((runs / "recover_s0" / "spec.json").read_text())["tp"] == 2
    assert json.loads((runs / "failure-free_s0" / "config.json").read_text())["train"]["tp"] == 2
    assert_every_planned_fault_fired(runs / "recover_s0")  # the plan's replica loss really struck
    rows = [r for r in csv.DictReader(open(tmp_path / "results" / "trajectory.csv")) if r["label"] == "recover"]
    assert len(rows) == 3 and {(r["shard"], r["tp"], r["pp"]) for r in rows} == {("1", "2", "1")}
    assert all(r["ids_match"] == "True" for r in rows)  # every step folded exactly the reference's ids
    assert max(float(r["rel_loss_diff"]) for r in rows) <= REL_TOL
