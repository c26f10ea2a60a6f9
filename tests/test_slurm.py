"""recover on a real Slurm cluster: two slurmd nodes on this machine (tests/slurm_cluster.py).

Every Slurm test is in this one file, so that the suite's workers (pytest-xdist,
--dist loadfile) stand one cluster up, not one each. Without Slurm's packages, or
not as root, they skip with one line saying why (`make test` installs the packages
when it runs as root, as CI does).

- `recover experiment trajectory --executor slurm --wait` runs failure-free (plain)
  and recover as 2-node jobs (one task per node, task 0 hosting the coordinator), and
  the planned replica loss fires on Slurm; the aggregated CSVs have the local
  executor's columns, and every per-step loss equals the local run's to 1e-5 relative.
- A node failure: recover's worker on n2 sets its own node DOWN mid-step (a
  `node_down` fault); Slurm ends the task there, the job (submitted --no-kill) runs on
  n1, and the trajectory equals failure-free; faults.jsonl and events.jsonl record it.
- Bad input: an unknown partition is one failed outcome naming sbatch's message and
  the script, at once.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, load_run
from recover.core.results import read_jsonl
from slurm_cluster import NODES, SlurmCluster, why_not

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

REL = 1e-5
STEPS = 4
GRID = ["trajectory", "--seeds", "0", "--systems", "recover", "--replicas", "2", "--steps", str(STEPS)]
SLURM = ["--executor", "slurm", "--wait", "--tasks-per-node", "1", "--cpus-per-task", "1", "--time", "10"]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    why = why_not()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()
    print(f"\nslurm cluster: {cluster.timings}")


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster):
    """The session's cluster, left as found: no job of this test still queued, every node back up."""
    yield slurm_cluster
    end = time.monotonic() + 60
    while slurm_cluster.queue() and time.monotonic() < end:
        time.sleep(0.5)
    leftover = slurm_cluster.queue()
    for job in leftover:
        slurm_cluster.cancel(job)
    for n in NODES:
        if slurm_cluster.node_state(n) != "idle":
            slurm_cluster.resume(n)
    assert not leftover, f"jobs still queued 60 s after the test: {leftover}"


def test_without_slurm_the_tests_skip_saying_why(monkeypatch) -> None:
    import slurm_cluster
    monkeypatch.setattr(slurm_cluster, "BINARIES", ("slurmctld", "no-such-slurm-binary"))
    why = slurm_cluster.why_not()
    assert why and "no-such-slurm-binary missing" in why and "make test" in why and "\n" not in why


def recover_cli(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "recover.experiments.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**env, "PYTHONUNBUFFERED": "1"})
    return proc


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]


def assert_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == STEPS, (a, b)
    assert a == pytest.approx(b, rel=REL), (a, b)


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory) -> Path:
    """The grid's failure-free and recover runs with the local executor: the reference."""
    import os
    root = tmp_path_factory.mktemp("local")
    proc = recover_cli("experiment", *GRID, "--executor", "local", "--out", str(root / "results"),
                       "--logs", str(root / "logs"), "--folder", str(root / "submitit"), env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "results"


def test_trajectory_grid_on_two_slurm_nodes_equals_local(cluster: SlurmCluster, local_runs: Path,
                                                         tmp_path: Path) -> None:
    proc = recover_cli("experiment", *GRID, *SLURM, "--out", str(tmp_path / "results"),
                       "--logs", str(tmp_path / "logs"), "--folder", str(tmp_path / "submitit"), env=cluster.env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ok" in proc.stdout, proc.stdout
    for name in ("failure-free_s0", "recover_s0"):
        run = tmp_path / "results" / "trajectory" / name
        assert_close(losses(run), losses(local_runs / "trajectory" / name))
        job = json.loads((run / "summary.json").read_text())["slurm_job"]
        # the job really spanned both nodes: one task (one replica) on each
        assert cluster.job_nodes(job) == "n[1-2]", cluster.job_nodes(job)
    # recover lost the planned replica on Slurm too (a real SIGKILL of its worker) and still matched
    assert_every_planned_fault_fired(tmp_path / "results" / "trajectory" / "recover_s0")
    for table in ("trajectory.csv", "trajectory_summary.csv"):
        with open(tmp_path / "results" / table) as a, open(local_runs / table) as b:
            assert next(csv.reader(a)) == next(csv.reader(b))
