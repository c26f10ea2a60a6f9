"""Experiment grids with the replica layout: a cell carries shard S to its TrainConfig,
a system that does not run the layout is refused when the grid is validated, the runs CSVs
carry the layout as a column, and `recover bench recovery --shard` is checked the same way.

All pure (grid expansion and validation, fixture results) but for the last test, which runs
one tiny grid of recover with 2 replicas x 2 ranks (marked procs).
"""
from __future__ import annotations

import csv
import json
import random
from argparse import Namespace

import pytest
from conftest import assert_every_planned_fault_fired, run_recover, write_aggregation_run

from recover.core.config.train_config import ConfigError
from recover.experiments import grids as E
from recover.experiments.aggregate import REL_TOL, SUMMARY_FIELDS, STEP_FIELDS, aggregate
from recover.experiments.benches.recovery import kill_plan
from recover.experiments.commands.bench import cmd_bench_recovery
from recover.experiments.launch_submitit import SlurmOptions, _submit_slurm, slurm_shape
from recover.core.config.replica_layout import ReplicaLayout
from recover.experiments.systems import SYSTEMS, check_layout, runs_layout

BASELINES = [name for name in SYSTEMS if name not in ("recover", "plain")]


# ---- grids --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(E.EXPERIMENTS))
def test_a_recover_grid_with_shard_2_validates_and_passes_s_to_its_config(name):
    grid = E.build_grid(name, seeds=[0], systems=["recover"], shard=2)
    rec = [r for r in grid.runs if r.system == "recover"]
    assert rec
    for r in rec:
        r.validate()
        assert r.shard == 2 and r.layout() == ReplicaLayout(shard=2)
        cfg = r.train_config("results")
        assert cfg.shard == 2 and cfg.batch_size >= 2
        assert r.nodes == 1  # local scale: CPU only
        faults = (r.plan or {}).get("faults", [])
        assert faults  # every recover cell has faults, addressed inside a replica of 2 ranks
        assert all(f.get("rank", 0) < 2 for f in faults)
        if name == "recovery":
            assert all(f["rank"] == 1 for f in faults)  # the last rank, behind the leader
    refs = [r for r in grid.runs if r.label == "failure-free"]
    if name == "recovery":
        assert not refs  # no failure-free reference in that experiment
    else:
        # plain runs the layout too: the failure-free reference runs at the grid's S
        assert refs and all(r.shard == 2 and r.train_config("results").shard == 2 for r in refs)
        same = {(r.batch_size, r.microbatches) for r in (x.train_config("x") for x in grid.runs)}
        assert len(same) == 1  # the same microbatches of the same rows: the same trajectory


def test_recover_fields_reach_every_recover_run_and_only_those_and_a_bad_one_is_refused_naming_it():
    grid = E.build_grid("trajectory", seeds=[0], replicas=2, recover={"replace_after": 1.0, "min_replicas": 2})
    for r in grid.runs:
        cfg = r.train_config("results")
        if r.system == "recover":
            assert (cfg.replace_after, cfg.min_replicas) == (1.0, 2)
        else:  # the other systems keep their own (and plain would refuse a replacement)
            assert (cfg.replace_after, cfg.min_replicas) == (-1.0, 1), r.name
    with pytest.raises(ValueError, match="recover_s0: --min-replicas: must be in"):
        E.build_grid("trajectory", seeds=[0], replicas=2, recover={"min_replicas": 3})


def test_throughput_failures_are_per_gpu_so_a_replica_of_2_fails_twice_as_often():
    plan = next(r.plan for r in E.build_grid("throughput", seeds=[0], systems=["recover"], shard=2).runs
                if r.plan)
    assert plan["generator"]["gpus_per_replica"] == 2


@pytest.mark.parametrize("name", list(E.EXPERIMENTS))
def test_shard_1_is_the_grid_as_before(name):
    plain = E.build_grid(name, seeds=[0])
    one = E.build_grid(name, seeds=[0], shard=1)
    assert [r.to_dict() for r in plain.runs] == [r.to_dict() for r in one.runs]
    assert plain.notes == one.notes
    for r in plain.runs:
        assert r.shard == 1 and r.train_config("x").shard == 1
        assert all("rank" not in f for f in (r.plan or {}).get("faults", []))  # plans unchanged


@pytest.mark.parametrize("system", BASELINES)  # every baseline runs S2 (torchft's FT-HSDP; sharded DCP restarts)
def test_a_shard_2_cell_of_every_baseline_validates_and_a_pp_2_cell_is_refused_naming_it(system):
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"])
    spec = next(r for r in grid.runs if r.system == "recover")
    spec.system, spec.settings, spec.shard = system, {}, 2
    spec.validate()
    spec.shard, spec.pp = 1, 2
    with pytest.raises(ConfigError, match=rf"^--system: {system} runs replicas split by S and TP only; "
                                          rf"{spec.replicas} x PP2 needs recover or plain$"):
        spec.validate()


def test_a_grid_at_shard_2_holds_every_system_and_a_bad_layout_fails_before_anything_starts():
    grid = E.build_grid("trajectory", seeds=[0], shard=2)
    assert {r.system for r in grid.runs} >= {"plain", "recover", *BASELINES} and all(r.shard == 2 for r in grid.runs)
    with pytest.raises(ValueError, match="layout shard: must be an integer >= 1"):
        E.build_grid("trajectory", seeds=[0], systems=["recover"], shard=0)


def test_the_registry_says_which_system_runs_which_layout():
    assert SYSTEMS["recover"].layout == ("shard", "tp", "pp")
    assert runs_layout("recover", ReplicaLayout(shard=4)) and runs_layout("recover", ReplicaLayout(shard=2, tp=2))
    assert runs_layout("recover", ReplicaLayout(tp=2, pp=2)) and runs_layout("plain", ReplicaLayout(pp=2))
    assert SYSTEMS["plain"].layout == SYSTEMS["recover"].layout  # the reference runs every layout recover runs
    assert all(runs_layout(s, ReplicaLayout()) for s in SYSTEMS)
    check_layout("plain", ReplicaLayout(tp=2, pp=2), 2)
    assert SYSTEMS["torchft"].layout == ("shard", "tp") and runs_layout("torchft", ReplicaLayout(shard=2, tp=2))
    with pytest.raises(ConfigError, match="^--system: torchft runs replicas split by S and TP only; 2 x PP2 needs "
                                          "recover or plain$"):
        check_layout("torchft", ReplicaLayout(pp=2), 2)


@pytest.mark.parametrize("layout, opts, shape", [
    # CPU-only: every rank of the run on one node
    (dict(shard=2), SlurmOptions(), (1, 8, 0)),
    # one task per node asked for: a replica's ranks still share a node (the failure domain)
    (dict(shard=2), SlurmOptions(tasks_per_node=1), (4, 2, 0)),
    # three ranks per node asked for: rounded down to one whole replica of two
    (dict(tp=2), SlurmOptions(tasks_per_node=3), (4, 2, 0)),
    # GPUs per node: two replicas of 2 x 2 ranks per 8-GPU node
    (dict(shard=2, pp=2), SlurmOptions(gpus_per_node=8), (2, 8, 8)),
])
def test_slurm_puts_whole_replicas_on_each_node(layout, opts, shape):
    spec = next(r for r in E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=4, **layout).runs
                if r.system == "recover")
    assert slurm_shape(spec, opts) == shape


def test_slurm_refuses_a_replica_larger_than_a_node_in_one_line(tmp_path):
    spec = next(r for r in E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, shard=2, tp=2).runs
                if r.system == "recover")
    out = _submit_slurm([spec], str(tmp_path), tmp_path / "submitit", SlurmOptions(gpus_per_node=2), wait=False,
                        echo=print)
    assert [o.status for o in out] == ["failed"]
    assert out[0].detail == ("a replica of 4 ranks does not fit a node of 2 GPUs: its ranks run on one node here "
                             "(lower --shard/--tp/--pp, or pass --tasks-per-node)")


# ---- aggregation --------------------------------------------------------------------------
def test_runs_csvs_carry_the_layout_and_charge_every_rank(tmp_path):
    write_aggregation_run(tmp_path, "ff", "plain")  # written before the layout: no shard
    write_aggregation_run(tmp_path, "recover", "recover", {"shard": 2}, faults=(1.5,))
    assert STEP_FIELDS.index("shard") == STEP_FIELDS.index("replicas") + 1
    assert SUMMARY_FIELDS.index("shard") == SUMMARY_FIELDS.index("replicas") + 1
    p_steps, p_summary, _ = aggregate(tmp_path, "exp")
    steps = list(csv.DictReader(open(p_steps)))
    assert {(r["run"], r["shard"]) for r in steps} == {("ff", "1"), ("recover", "2")}
    assert all(r["on_trajectory"] == "True" for r in steps if r["run"] == "recover")
    s = {r["run"]: r for r in csv.DictReader(open(p_summary))}
    assert s["ff"]["shard"] == "1" and s["recover"]["shard"] == "2"
    # 2 replicas of 2 ranks until step 1's commit at 2 s (both its members: the loss at 1.5 s
    # is charged from then on), then 1 replica of 2 ranks to the last commit at 4 s
    assert float(s["recover"]["process_hours"]) * 3600 == pytest.approx(2 * (2 * 2 + 2 * 1))
    assert float(s["ff"]["process_hours"]) * 3600 == pytest.approx(4 * 2)


# ---- bench recovery -----------------------------------------------------------------------
def test_kill_plans_strike_a_rank_only_when_replicas_have_many():
    one = kill_plan(random.Random(3), 4, 3, 30, first=4, gap=5)
    assert kill_plan(random.Random(3), 4, 3, 30, first=4, gap=5, shard=1) == one
    assert all("rank" not in f for f in one)
    two = kill_plan(random.Random(3), 4, 3, 30, first=4, gap=5, shard=2)
    assert all(0 <= f["rank"] < 2 for f in two)


def test_random_kill_placement_covers_the_checkpoint_period():
    """Each kill lands at a uniformly drawn step of its window, so against a checkpoint every `gap`
    steps every offset in the period occurs; `fixed` keeps every kill at its window's first step."""
    offsets = set()
    for seed in range(40):
        plan = kill_plan(random.Random(seed), 4, 3, 30, first=4, gap=5)
        for i, f in enumerate(plan):
            assert 4 + 5 * i <= f["step"] < 4 + 5 * (i + 1)
            offsets.add(f["step"] - 4 - 5 * i)
    assert offsets == set(range(5))
    fixed = kill_plan(random.Random(3), 4, 3, 30, first=4, gap=5, placement="fixed")
    assert [f["step"] for f in fixed] == [4, 9, 14]
    with pytest.raises(ValueError):
        kill_plan(random.Random(3), 4, 3, 30, first=4, gap=5, placement="worst")


def _bench_args(**kw) -> Namespace:
    base = dict(system="recover", kills=1, replicas=2, microbatches=4, seed=0, heartbeat_timeout=3.0,
                clean_steps=3, repeats=1, out="x", work="", shard=2)
    return Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    ({"system": "elastic", "pp": 2, "shard": 1}, "recover: error: --system: elastic runs replicas split by S and "
                                                 "TP only; 2 x PP2 needs recover or plain"),
    ({"shard": 0}, "recover: error: --shard: must be >= 1, got 0"),
    ({"shard": 8}, "recover: error: --shard: each rank takes rows of a microbatch"),
])
def test_bench_recovery_checks_the_layout_before_any_run(kw, message, capsys, monkeypatch):
    import recover.experiments.benches.recovery as bench

    monkeypatch.setattr(bench, "bench_recovery", lambda a: pytest.fail("a run started"))
    assert cmd_bench_recovery(_bench_args(**kw)) == 2
    assert capsys.readouterr().err.startswith(message)


# ---- one tiny real grid -------------------------------------------------------------------
@pytest.mark.procs
def test_a_tiny_recover_grid_of_2_replicas_x_2_ranks_runs_and_aggregates(tmp_path):
    args = ["experiment", "trajectory", "--executor", "local", "--seeds", "0", "--systems", "recover",
            "--replicas", "2", "--shard", "2", "--steps", "3", "--out", str(tmp_path / "results"),
            "--logs", str(tmp_path / "logs"), "--folder", str(tmp_path / "submitit")]
    proc = run_recover(*args, timeout=400)
    assert proc.returncode == 0 and "2 ok" in proc.stdout, proc.stdout + proc.stderr
    assert json.loads((runs_dir := tmp_path / "results" / "trajectory" / "failure-free_s0" / "config.json")
                      .read_text())["train"]["shard"] == 2, runs_dir  # plain runs the grid's layout too
    runs = tmp_path / "results" / "trajectory"
    assert json.loads((runs / "recover_s0" / "config.json").read_text())["train"]["shard"] == 2
    assert json.loads((runs / "recover_s0" / "spec.json").read_text())["shard"] == 2
    assert_every_planned_fault_fired(runs / "recover_s0")
    rows = [r for r in csv.DictReader(open(tmp_path / "results" / "trajectory.csv")) if r["label"] == "recover"]
    assert len(rows) == 3 and {r["shard"] for r in rows} == {"2"}
    assert all(r["ids_match"] == "True" for r in rows)
    assert max(float(r["rel_loss_diff"]) for r in rows) <= REL_TOL


def test_bench_recovery_sets_torchft_s_lighthouse_for_torchft_only(capsys, monkeypatch):
    import recover.experiments.benches.recovery as bench

    monkeypatch.setattr(bench, "bench_recovery", lambda a: 0)
    assert cmd_bench_recovery(_bench_args(system="recover", torchft_heartbeat_timeout_ms=250)) == 2
    assert "--torchft-heartbeat-timeout-ms: sets torchft's lighthouse; --system is recover" in capsys.readouterr().err
    assert cmd_bench_recovery(_bench_args(system="torchft", torchft_join_timeout_ms=0)) == 2
    assert "--torchft-join-timeout-ms: must be >= 1, got 0" in capsys.readouterr().err
    tight = _bench_args(system="torchft", torchft_heartbeat_timeout_ms=250, torchft_join_timeout_ms=250)
    assert cmd_bench_recovery(tight) == 0  # 3 x S2 (here 2 x S2): torchft's fault-tolerant HSDP
    s = bench.torchft_settings(tight)
    assert (s.torchft_heartbeat_timeout_ms, s.torchft_join_timeout_ms) == (250, 250)
    assert bench._settings_suffix(s) == "_hb250_join250"  # beside the default's files, not over them
    default = bench.torchft_settings(_bench_args(system="torchft"))
    assert (default.torchft_heartbeat_timeout_ms, default.torchft_join_timeout_ms) == (1000, 1000)
    assert bench._settings_suffix(default) == ""
    assert bench.torchft_settings(_bench_args()) is None  # recover: no torchft settings


def test_bench_recovery_times_a_kill_to_the_first_commit_without_the_killed_replica(tmp_path):
    """A step voted before the kill (torchft commits it after a kill in optimizer_step) is the
    next commit, not the end of the recovery: kill_to_regroup_s runs to the first commit without it."""
    from recover.experiments.benches.recovery import measure_run

    members = [[0, 1, 2]] * 4 + [[0, 2]] * 2
    walls = [1.0, 2.0, 3.0, 3.05, 4.5, 5.0]  # the kill at 3.01: step 3 (voted before it) lands at 3.05
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, (m, w) in enumerate(zip(members, walls)):
            f.write(json.dumps({"step": i, "loss": 1.0, "tokens": 1, "microbatch_ids": [i], "generation": 0,
                                "members": m, "wall_time": w}) + "\n")
    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "faults.jsonl").write_text(json.dumps({"kind": "crash", "replica": 1, "step": 3,
                                                       "phase": "optimizer_step", "wall_time": 3.01}) + "\n")
    (kill,) = measure_run(tmp_path)["kills"]
    assert kill["kill_to_next_commit_s"] == pytest.approx(0.04)
    assert kill["kill_to_regroup_s"] == pytest.approx(1.49)
