"""Experiment grids, their launch (local, debug, the Slurm task body, sbatch files), aggregation and figures.

Real runs here are tiny (2 replicas, a few steps); the Slurm path is checked by the
sbatch files it writes to a stand-in `sbatch` on PATH, and its per-rank task body
runs for real as a multi-task submitit job on this machine.
"""
from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, run_recover
from recover.experiments import grids as E
from recover.experiments.aggregate import REL_TOL, aggregate, headline
from recover.experiments.launch_submitit import is_complete, slurm_task, submit_grid
from recover.experiments.systems import SYSTEMS

REPO = Path(__file__).resolve().parent.parent
FIG_SCRIPTS = ["trajectory", "throughput", "recovery"]


# ---- grids ------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", list(E.SCALES))
@pytest.mark.parametrize("name", list(E.EXPERIMENTS))
def test_every_grid_builds_and_validates(name: str, scale: str) -> None:
    grid = E.build_grid(name, scale=scale)
    assert grid.runs, grid.notes
    assert len({r.name for r in grid.runs}) == len(grid.runs)
    for r in grid.runs:
        assert r.system in SYSTEMS
        r.validate()
        assert r.model == E.SCALES[scale].model
        assert r.microbatches >= r.replicas
        if r.system == "plain":  # failure-free (and failure-free-exact): the references
            assert r.plan is None
        else:
            assert r.plan and r.plan["faults"] and len(r.plan["faults"]) < r.replicas  # someone always survives
    # every faulty system of one seed gets the very same faults
    by_seed: dict[tuple, list] = {}
    for r in grid.runs:
        if r.plan is not None:
            by_seed.setdefault((r.seed, r.replicas, r.fault_kind), []).append(json.dumps(r.plan, sort_keys=True))
    assert all(len(set(plans)) == 1 for plans in by_seed.values())
    missing = {r.label for r in E.EXPERIMENTS[name]([0], E.SCALES[scale]) if r.system not in SYSTEMS}
    assert len([n for n in grid.notes if "not registered" in n]) == len(missing)  # one note per label left out
    assert not any((r.system, r.fault_kind) in E.KNOWN_BROKEN for r in grid.runs)


def test_paper_scale_is_64_nodes_of_8_gpus() -> None:
    grid = E.build_grid("trajectory", seeds=[0], scale="paper-512")
    r = next(r for r in grid.runs if r.label == "recover")
    assert (r.replicas, r.nodes, r.gpus_per_node, r.model) == (512, 64, 8, "gpt2-124m")
    assert len(r.plan["faults"]) == 256  # half the GPUs lost, spread over the run
    rec = E.build_grid("recovery", scale="paper-512")
    assert max(r.replicas for r in rec.runs) == 512


def test_unregistered_system_is_skipped_with_a_note(monkeypatch) -> None:
    monkeypatch.setattr(E, "SYSTEMS", {k: v for k, v in SYSTEMS.items() if k != "ckpt-restart"})
    grid = E.build_grid("trajectory", seeds=[0])
    assert not any(r.system == "ckpt-restart" for r in grid.runs)
    assert any("ckpt-restart" in n and "not registered" in n for n in grid.notes)


def test_a_bad_run_fails_validation() -> None:
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"])
    spec = next(r for r in grid.runs if r.label == "recover")
    spec.plan = {"faults": [{"kind": "crash", "replica": 9, "step": 1, "phase": "forward"}]}
    with pytest.raises(ValueError, match="replica"):
        spec.validate()


# ---- launching here -----------------------------------------------------------------------
@pytest.mark.procs
def test_local_executor_runs_a_tiny_grid_and_a_rerun_skips_it(tmp_path: Path) -> None:
    args = ["experiment", "trajectory", "--executor", "local", "--seeds", "0", "--systems", "recover",
            "--replicas", "2", "--steps", "5", "--out", str(tmp_path / "results"), "--logs", str(tmp_path / "logs"),
            "--folder", str(tmp_path / "submitit")]
    first = run_recover(*args, check=True)
    assert "2 ok" in first.stdout, first.stdout
    runs = tmp_path / "results" / "trajectory"
    for name in ("failure-free_s0", "recover_s0"):
        assert is_complete(runs / name, 5)
        assert not (runs / name / "logs").exists()  # moved out, so results stay small
        assert not (runs / name / E.PLAN_INPUT).exists()
        summary = json.loads((runs / name / "summary.json").read_text())
        assert Path(summary["logs"], "logs").is_dir()
    assert len(json.loads((runs / "recover_s0" / "fault_plan.json").read_text())["faults"]) == 1
    assert_every_planned_fault_fired(runs / "recover_s0")
    rows = list(csv.DictReader(open(tmp_path / "results" / "trajectory.csv")))
    assert len(rows) == 10 and {r["label"] for r in rows} == {"failure-free", "recover"}
    rec = [r for r in rows if r["label"] == "recover"]
    assert all(r["ids_match"] == "True" for r in rec)
    assert max(float(r["rel_loss_diff"]) for r in rec) <= REL_TOL
    before = (runs / "recover_s0" / "metrics.jsonl").read_text()
    again = run_recover(*args, check=True)
    assert "2 skipped" in again.stdout, again.stdout
    assert (runs / "recover_s0" / "metrics.jsonl").read_text() == before


@pytest.mark.procs
def test_a_failed_run_is_reported_with_its_log_path(tmp_path: Path) -> None:
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=4)
    spec = next(r for r in grid.runs if r.label == "recover")
    # both replicas die: the run cannot finish, and says so
    spec.plan = {"faults": [{"kind": "crash", "replica": 0, "step": 1, "phase": "forward"},
                            {"kind": "crash", "replica": 1, "step": 1, "phase": "forward"}]}
    grid.runs = [spec]
    out = submit_grid(grid, "debug", root=tmp_path / "results", logs_root=tmp_path / "logs",
                      folder=tmp_path / "submitit", echo=lambda s: None)
    assert [o.status for o in out] == ["failed"]
    assert str(tmp_path / "logs" / "trajectory" / spec.name) in out[0].detail
    assert (tmp_path / "logs" / "trajectory" / spec.name / "logs" / "coordinator.log").exists()
    assert_every_planned_fault_fired(spec.out_dir(tmp_path / "results"))  # both crashes happened


@pytest.mark.procs
def test_slurm_task_body_runs_one_rank_per_task(tmp_path: Path) -> None:
    """The Slurm job body, as a 2-task submitit job here: task 0 hosts the coordinator."""
    import submitit

    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=4)
    spec = next(r for r in grid.runs if r.label == "recover")
    ex = submitit.AutoExecutor(folder=str(tmp_path / "submitit"), cluster="local")
    ex.update_parameters(tasks_per_node=2, timeout_min=5)
    job = ex.submit(slurm_task, spec.to_dict(), str(tmp_path / "results"))
    results = job.results()
    codes = {r["rank"]: r["returncode"] for r in results}
    victim = spec.plan["faults"][0]["replica"]
    # the planned crash is a real SIGKILL of that rank's worker; the other rank finishes the run
    assert codes == {victim: -9, 1 - victim: 0}
    run = spec.out_dir(tmp_path / "results")
    assert is_complete(run, 4)
    assert not (run / E.PLAN_INPUT).exists()
    assert json.loads((run / "summary.json").read_text())["slurm_job"] == str(job.job_id)
    assert [f["replica"] for f in assert_every_planned_fault_fired(run)] == [victim]


# ---- Slurm: the sbatch files -----------------------------------------------------------------
def _stand_ins(bin_dir: Path, record: Path) -> None:
    bin_dir.mkdir()
    scripts = {
        # records the script it is given and answers as sbatch does
        "sbatch": f'#!/bin/sh\ncat "$1" >> {record}\necho "=====" >> {record}\necho "Submitted batch job 4242"\n',
        "srun": "#!/bin/sh\nexit 0\n",  # submitit only checks that it exists
        "sacct": "#!/bin/sh\nexit 0\n",
        "squeue": "#!/bin/sh\nexit 0\n",
        "scancel": "#!/bin/sh\nexit 0\n",
    }
    for name, text in scripts.items():
        p = bin_dir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.mark.procs
def test_slurm_paper_scale_sbatch_content(tmp_path: Path) -> None:
    record = tmp_path / "sbatch_record.txt"
    _stand_ins(tmp_path / "bin", record)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "recover.experiments.cli", "experiment", "trajectory", "--executor", "slurm",
         "--scale", "paper-512", "--seeds", "0", "--partition", "gpu", "--account", "llm", "--time", "600",
         "--out", str(tmp_path / "results"), "--folder", str(tmp_path / "submitit"),
         "--setup", "source /shared/venv/bin/activate"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = record.read_text()
    scripts = [s for s in text.split("=====") if s.strip()]
    # failure-free, recover, torchft, both elastic variants and the two --exact runs (failure-free-exact,
    # recover-exact) share one shape: one array; ckpt-restart, the same shape but requeued on failure,
    # is an array of its own
    assert len(scripts) == 2
    s, ckpt = scripts
    for line in ["#SBATCH --nodes=64", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=llm", "#SBATCH --time=600",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --job-name=recover-trajectory", "#SBATCH --array=0-6%4",  # 7 runs, at most --array-parallelism (4) at once
                 "#SBATCH --no-kill", "source /shared/venv/bin/activate"]:
        assert line in s, f"{line!r} not in\n{s}"
    assert "#SBATCH --requeue" not in s and "#SBATCH --requeue" in ckpt and "#SBATCH --nodes=64" in ckpt
    srun = next(x for x in s.splitlines() if x.startswith("srun "))
    assert "--unbuffered" in srun and "--no-kill" in srun and "-m submitit.core._submit" in srun
    assert str(tmp_path / "submitit") in srun
    assert "submitted  failure-free_s0  job 4242_0 (64 node(s) x 8 task(s))" in proc.stdout
    # every system of the grid has a Slurm form now: none is skipped
    assert "skipped" not in proc.stdout, proc.stdout


@pytest.mark.procs
def test_slurm_recovery_sweep_is_one_array_per_job_shape(tmp_path: Path) -> None:
    record = tmp_path / "sbatch_record.txt"
    _stand_ins(tmp_path / "bin", record)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "recover.experiments.cli", "experiment", "recovery", "--executor", "slurm",
         "--scale", "paper-512", "--systems", "recover", "--out", str(tmp_path / "results"),
         "--folder", str(tmp_path / "submitit")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scripts = [s for s in record.read_text().split("=====") if s.strip()]
    nodes = sorted(int(next(x for x in s.splitlines() if x.startswith("#SBATCH --nodes=")).split("=")[1])
                   for s in scripts)
    assert nodes == [1, 8, 16, 32, 64]  # 8, 64, 128, 256, 512 replicas at 8 per node


# ---- aggregation and figures on fixture results --------------------------------------------
def _write_run(root: Path, exp: str, name: str, system: str, seed: int, losses: list[float], ids_of, *,
               label: str = "", reference: str = "", faults: list[float] = (), members=None, dt: float = 1.0,
               checksum: float | None = None, fault_kind: str = "", replicas: int = 4) -> None:
    d = root / exp / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"train": {"system": system, "seed": seed, "replicas": replicas,
                                                         "steps": len(losses)}}))
    spec = {"label": label or system, "reference": reference, "fault_kind": fault_kind}
    (d / "spec.json").write_text(json.dumps(spec))
    with open(d / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses):
            m = members(i) if members else list(range(replicas))
            f.write(json.dumps({"step": i, "loss": loss, "tokens": 100 * len(ids_of(i)), "microbatch_ids": ids_of(i),
                                "generation": 0, "members": m, "wall_time": dt * (i + 1)}) + "\n")
    with open(d / "faults.jsonl", "w") as f:
        for t in faults:
            f.write(json.dumps({"kind": "crash", "replica": 3, "step": int(t), "phase": "forward", "wall_time": t}) + "\n")
    summary = {"status": "ok", "steps": len(losses)}
    if checksum is not None:
        summary["weights_checksum"] = checksum
    (d / "summary.json").write_text(json.dumps(summary))


def _fixture(root: Path) -> None:
    full = lambda i: list(range(8 * i, 8 * i + 8))  # noqa: E731
    half = lambda i: full(i) if i < 3 else full(i)[:4]  # noqa: E731 - a shrinking global batch
    base = [5.0 - 0.1 * i for i in range(8)]
    for exp in ("trajectory", "throughput"):
        for seed in (0, 1):
            ref = f"failure-free_s{seed}"
            _write_run(root, exp, ref, "plain", seed, base, full, label="failure-free", checksum=10.0)
            _write_run(root, exp, f"recover_s{seed}", "recover", seed, [x + 1e-7 for x in base], full,
                       reference=ref, faults=[2.5], members=lambda i: [0, 1, 2] if i >= 2 else [0, 1, 2, 3])
            _write_run(root, exp, f"ckpt-restart_s{seed}", "ckpt-restart", seed, base, full, reference=ref,
                       faults=[2.5], dt=2.0, checksum=10.0)
            _write_run(root, exp, f"torchft_s{seed}", "torchft", seed, [x + (0.05 if i >= 3 else 0) for i, x in
                                                                       enumerate(base)], half, reference=ref,
                       faults=[2.5])
    for r in (2, 4, 8):
        for kind in ("crash", "hang"):
            for system, slow in (("recover", 0.1), ("ckpt-restart", 3.0)):
                _write_run(root, "recovery", f"{system}_{kind}_r{r}_s0", system, 0, base, full, faults=[3.0 - slow / 2],
                           fault_kind=kind, replicas=r)


def test_aggregation_of_fixture_results(tmp_path: Path) -> None:
    _fixture(tmp_path)
    p_steps, p_summary, summaries = aggregate(tmp_path, "trajectory")
    rows = {(r["run"], int(r["step"])): r for r in csv.DictReader(open(p_steps))}
    assert rows[("recover_s0", 5)]["on_trajectory"] == "True"
    assert rows[("torchft_s0", 2)]["on_trajectory"] == "True"
    assert rows[("torchft_s0", 3)]["on_trajectory"] == "False" and rows[("torchft_s0", 3)]["ids_match"] == "False"
    assert rows[("recover_s0", 2)]["faults_fired"] == "1" and rows[("recover_s0", 1)]["faults_fired"] == "0"
    assert rows[("recover_s0", 2)]["faults_at_step"] == "1" and rows[("recover_s0", 3)]["faults_at_step"] == "0"
    s = {r["run"]: r for r in csv.DictReader(open(p_summary))}
    assert float(s["recover_s0"]["max_abs_loss_diff"]) == pytest.approx(1e-7, rel=1e-3)
    assert int(s["torchft_s0"]["steps_on_trajectory"]) == 3
    assert float(s["torchft_s0"]["effective_tokens"]) == 3 * 800
    # goodput counts torchft's off-trajectory steps too: more tokens than its effective ones, same seconds
    ft = s["torchft_s0"]
    assert float(ft["goodput_tokens_per_s"]) == pytest.approx(float(ft["tokens"]) / float(ft["train_seconds"]))
    assert float(ft["goodput_tokens_per_s"]) > float(ft["effective_tokens_per_s"])
    assert float(s["ckpt-restart_s0"]["weights_checksum_diff"]) == 0.0
    assert s["recover_s0"]["final_param_distance"] == ""  # not recorded by any system
    # recover: all 8 steps x 800 tokens in 8 s; ckpt-restart: the same tokens in 16 s
    assert float(s["recover_s0"]["effective_tokens_per_s"]) == pytest.approx(800.0)
    assert float(s["ckpt-restart_s0"]["effective_tokens_per_s"]) == pytest.approx(400.0)
    # start-up apart: the first commit's wall time; throughput from it to the last commit (7 steps after it)
    assert float(s["recover_s0"]["startup_seconds"]) == 1.0 and float(s["ckpt-restart_s0"]["startup_seconds"]) == 2.0
    assert float(s["recover_s0"]["effective_tokens_per_s_from_first_commit"]) == pytest.approx(7 * 800 / 7)
    assert float(s["ckpt-restart_s0"]["effective_tokens_per_s_from_first_commit"]) == pytest.approx(7 * 800 / 14)
    # process-seconds: 4 processes until the loss at 2.5 s, then 3 (to the last commit at 8 s)
    assert float(s["recover_s0"]["process_hours"]) * 3600 == pytest.approx(2.5 * 4 + 5.5 * 3)
    # ckpt-restart holds all 4 until its loss at 2.5 s (its members never shrink in the fixture: 4 throughout)
    assert float(s["ckpt-restart_s0"]["process_hours"]) * 3600 == pytest.approx(16 * 4)
    assert float(s["recover_s0"]["recovery_seconds"]) == pytest.approx(0.5)
    h = headline(summaries)
    assert h["recover_over_ckpt_restart"]["effective_tokens_per_s"] == pytest.approx(2.0)
    _, p_rec, _ = aggregate(tmp_path, "recovery")
    rec = {r["run"]: r for r in csv.DictReader(open(p_rec))}
    # faults at 2.95 s and 1.5 s; the next commits at 3 s and 2 s
    assert float(rec["recover_hang_r8_s0"]["recovery_seconds"]) == pytest.approx(0.05)
    assert float(rec["ckpt-restart_hang_r8_s0"]["recovery_seconds"]) == pytest.approx(0.5)


@pytest.mark.procs
@pytest.mark.parametrize("script", FIG_SCRIPTS)
def test_figure_scripts_draw_fixture_results(tmp_path: Path, script: str) -> None:
    _fixture(tmp_path)
    for exp in ("trajectory", "throughput", "recovery"):
        aggregate(tmp_path, exp)
    proc = subprocess.run([sys.executable, str(REPO / "paper_figs" / f"{script}.py"), "--results", str(tmp_path),
                           "--out", str(tmp_path / "figs")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for ext in ("png", "pdf"):
        assert (tmp_path / "figs" / f"{script}.{ext}").stat().st_size > 1000


@pytest.mark.procs
def test_figure_script_names_a_missing_csv(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "paper_figs" / "trajectory.py"), "--results", str(tmp_path),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "trajectory.csv" in proc.stderr


def test_recover_figs_discovers_every_figure_script() -> None:
    from recover.experiments.commands.figs import figure_scripts

    names = {p.stem for p in figure_scripts()}
    assert set(FIG_SCRIPTS) <= names
    assert "exp_common" not in names and "sim_common" not in names
    assert {p.stem for p in (REPO / "paper_figs").glob("sim_*.py")} - {"sim_common"} <= names
