"""recover on a real Slurm cluster: two slurmd nodes on this machine (tests/slurm_cluster.py).

Every Slurm test is in this one file, so that the suite's workers (pytest-xdist,
--dist loadfile) stand one cluster up, not one each. Without Slurm's packages, or
not as root, they skip with one line saying why (`make test` installs the packages
when it runs as root, as CI does).

- `recover experiment trajectory --executor slurm --wait` runs failure-free (plain),
  recover, checkpoint-restart, torchft and elastic (keep-global) as 2-node jobs (one
  task per node, task 0 hosting the coordinator: recover's, a bare store, or torchft's
  lighthouse; elastic's tasks are torchrun agents around task 0's store), and the
  planned replica loss fires on Slurm: recover and torchft train on, elastic's other
  agent re-forms the group alone, and checkpoint-restart's job is requeued by Slurm
  (`scontrol requeue` from task 0) and resumes from its last complete checkpoint with
  the survivor. The aggregated CSVs have the local executor's columns, and every per-step
  loss equals the local failure-free run's to 1e-5 relative (torchft's up to the loss:
  what follows depends on its quorum's timing).
- A node failure: recover's worker on n2 sets its own node DOWN mid-step (a
  `node_down` fault); Slurm ends the task there, the job (submitted --no-kill) runs on
  n1, and the trajectory equals failure-free; faults.jsonl and events.jsonl record it.
  With --replace-after, the replacement job queued for it finds no node (n2 down, n1
  the run's) and is cancelled when the run ends.
- Replicas of two ranks (2 x S2): a replica's ranks share a node; a `node_down` from
  replica 1's leader takes its node and both its ranks, and replica 0 trains on with the
  failure-free run's microbatches.
- Replacements (`replace_after`, `min_replicas` 2), at 2 x S2 (parametrized by S; S=1 passes
  too, left out to keep the file's time): a
  `node_down` of replica 1 at step 1; task 0 submits a one-node replacement job, pending
  while n2 is down; n2 returns, the job runs there, its ranks are admitted and healed,
  and the last steps are folded by both replicas with the failure-free ids (the
  workers' ledgers and final checksums); the job has left the queue. A replacement job
  that can never start (PartitionConfig) is cancelled with one line. A replica whose
  worker SIGKILLed itself (its node still in the job) is replaced on that node, healed,
  and the run ends at full strength.
- Bad input: an unknown partition (sbatch refuses it) and a job no node can hold
  (queued, pending for PartitionConfig) are each one failed line per run, at once,
  naming Slurm's reason and the job's script and log; nothing is left queued.
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
from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids
from slurm_cluster import NODES, SlurmCluster, why_not

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

REL = 1e-5
STEPS = 4
# checkpoint-restart: a checkpoint every 2 steps, so its restart resumes from one (step 2)
GRID = ["trajectory", "--seeds", "0", "--systems", "recover", "ckpt-restart", "torchft", "elastic-keep-global",
        "--replicas", "2", "--steps", str(STEPS), "--checkpoint-every", "2"]
SLURM = ["--executor", "slurm", "--wait", "--tasks-per-node", "1", "--cpus-per-task", "1", "--time", "10"]


# Module scope: this file holds every Slurm test, so this is the one cluster of the
# worker's session, and it is stopped as soon as the file is done, not at the session's end.
@pytest.fixture(scope="module")
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
    return [m["loss"] for m in read_metrics(run / "metrics.jsonl")]


def assert_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == STEPS, (a, b)
    assert a == pytest.approx(b, rel=REL), (a, b)


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory) -> Path:
    """The grid's failure-free run with the local executor: the trajectory every system's run on
    Slurm is held to (locally, recover, checkpoint-restart and elastic keep-global equal it to the
    bit, and torchft up to its loss; so one local run is the reference, not five)."""
    import os
    root = tmp_path_factory.mktemp("local")
    proc = recover_cli("experiment", *GRID[:GRID.index("--systems") + 1], "failure-free",
                       *GRID[GRID.index("--replicas"):], "--executor", "local", "--out", str(root / "results"),
                       "--logs", str(root / "logs"), "--folder", str(root / "submitit"), env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "results"


def test_trajectory_grid_on_two_slurm_nodes_equals_local(cluster: SlurmCluster, local_runs: Path,
                                                         tmp_path: Path) -> None:
    proc = recover_cli("experiment", *GRID, *SLURM, "--out", str(tmp_path / "results"),
                       "--logs", str(tmp_path / "logs"), "--folder", str(tmp_path / "submitit"), env=cluster.env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 ok" in proc.stdout, proc.stdout
    reference = read_metrics(local_runs / "trajectory" / "failure-free_s0" / "metrics.jsonl")
    for name in ("failure-free_s0", "recover_s0", "ckpt-restart_s0", "torchft_s0", "elastic-keep-global_s0"):
        run = tmp_path / "results" / "trajectory" / name
        if name == "torchft_s0":
            # torchft's lighthouse ran as task 0's coordinator. Which steps shrink after the loss
            # depends on when its quorum notices (timing), and so does the first quorum: a task
            # that starts more than the lighthouse's join timeout after the other (two slurmd's
            # spawning under load; seen in a run) misses it, and step 0 trains on the other's
            # half of the batch, as torchft does. So the steps compared are those before the
            # fault, from step 0, that had both replicas; every step's batch is checked against
            # the members the run reported.
            [fault] = assert_every_planned_fault_fired(run)
            metrics = read_metrics(run / "metrics.jsonl")
            assert [m["step"] for m in metrics] == list(range(STEPS)), metrics
            per_replica = reference[0]["tokens"] // len(reference[0]["members"])
            assert all(m["tokens"] == per_replica * len(m["members"]) for m in metrics), metrics
            both = 0
            while both < fault["step"] and metrics[both]["members"] == [0, 1]:
                both += 1
            here, there = losses(run)[:both], [m["loss"] for m in reference[:both]]
            assert here == pytest.approx(there, rel=REL), (both, here, there)
            assert metrics[-1]["members"] == [1 - fault["replica"]]
        else:
            assert_close(losses(run), [m["loss"] for m in reference])
        job = json.loads((run / "summary.json").read_text())["slurm_job"]
        # the job really spanned both nodes: one task (one replica) on each
        assert cluster.job_nodes(job) == "n[1-2]", cluster.job_nodes(job)
    # recover lost the planned replica on Slurm too (a real SIGKILL of its worker) and still matched
    assert_every_planned_fault_fired(tmp_path / "results" / "trajectory" / "recover_s0")
    # checkpoint-restart lost it too: its job was requeued by Slurm and trained on from its last
    # complete checkpoint with the survivor, as the local supervisor restarts it
    ckpt = tmp_path / "results" / "trajectory" / "ckpt-restart_s0"
    [fault] = assert_every_planned_fault_fired(ckpt)
    _, metrics, summary = load_run(ckpt)
    [restart] = [e for e in read_jsonl(ckpt / "events.jsonl") if e["kind"] == "restart"]
    assert summary["restarts"] == 1 and restart["generation"] == 1, (summary, restart)
    assert restart["restarted_by"] == "slurm requeue" and restart["failed_replicas"] == [fault["replica"]]
    assert cluster.restarts(summary["slurm_job"]) == 1  # by Slurm's own account
    assert restart["members"] == [1 - fault["replica"]] == metrics[-1]["members"], (restart, metrics[-1])
    assert restart["from_step"] == 2 and restart["from_step"] <= fault["step"], restart  # the checkpoint of step 2
    # elastic lost the node of the planned replica (its torchrun agent went with the worker): the
    # other agent re-formed the group alone, from the last complete checkpoint
    elastic = tmp_path / "results" / "trajectory" / "elastic-keep-global_s0"
    [fault] = assert_every_planned_fault_fired(elastic)
    _, metrics, summary = load_run(elastic)
    assert summary["restarts"] == 1 and metrics[-1]["members"] == [1 - fault["replica"]], (summary, metrics[-1])
    for table in ("trajectory.csv", "trajectory_summary.csv"):
        with open(tmp_path / "results" / table) as a, open(local_runs / table) as b:
            assert next(csv.reader(a)) == next(csv.reader(b))


def test_a_node_set_down_mid_step_recover_runs_on(cluster: SlurmCluster, local_runs: Path, tmp_path: Path,
                                                  monkeypatch) -> None:
    """Replica 1's worker sets its own node (n2) DOWN at step 2: Slurm ends its task, the job runs on;
    the replacement job task 0 queues for it (--replace-after) is cancelled when the run ends."""
    from recover.experiments import grids as E
    from recover.experiments.launch_submitit import SlurmOptions, submit_grid

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=STEPS)
    spec = next(r for r in grid.runs if r.label == "recover")
    # replica 0 paced from step 2 (0.4 s a microbatch at least): its last steps alone then outlast
    # the replacer's first look at the job's nodes (poll_s) and its sbatch; unpaced, a quiet
    # machine ended the run before the loss was seen, and no replacement was queued
    spec.plan = {"faults": [{"kind": "node_down", "replica": 1, "step": 2, "phase": "backward"},
                            {"kind": "pace", "replica": 0, "step": 2, "phase": "forward", "seconds": 0.4}]}
    spec.overrides.update(replace_after=0.0)  # its replacement finds no node: n2 is down, n1 is replica 0's
    grid.runs = [spec]
    opts = SlurmOptions(tasks_per_node=1, cpus_per_task=1, time_min=10, poll_s=0.5)
    out = submit_grid(grid, "slurm", root=tmp_path / "results", folder=tmp_path / "submitit", slurm=opts)
    assert [(o.status) for o in out] == ["submitted", "ok"], out
    run = spec.out_dir(tmp_path / "results")
    config, metrics, summary = load_run(run)
    job = summary["slurm_job"]
    # The node really went down, by Slurm's own account, and took replica 1's task with it.
    assert cluster.node_state("n2").startswith("down"), cluster.node_state("n2")
    assert "recover fault 0: node_down of replica 1 at step 2" in cluster.node_reason("n2")
    # The job was not ended with its node (no NODE_FAIL): Slurm shrank it (RESIZING) and it ran to
    # its end, where sacct says FAILED only because srun reports the task the node took.
    states = cluster.final_job_states(job)
    assert states == ["RESIZING", "FAILED"], states
    [fired] = [f for f in assert_every_planned_fault_fired(run) if f["kind"] == "node_down"]
    assert fired["step"] == 2
    [recovery] = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "recovery"]
    assert (recovery["step"], recovery["survivors"]) == (2, [0]), recovery
    assert "replica 1 lost" in recovery["fault"], recovery
    # The run went on with replica 0 alone and stayed on the failure-free trajectory.
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert metrics[-1]["members"] == [0], metrics[-1]
    assert_close(losses(run), losses(local_runs / "trajectory" / "failure-free_s0"))
    # --replace-after: a replacement job was queued for replica 1, found no node before the run
    # ended, and was cancelled then: nothing left in the queue
    assert len(summary["replacements"]) == 1, summary["replacements"]  # (what became of each, if not one)
    [record] = summary["replacements"]
    assert (record["replica"], record["started_at"]) == (1, None), record
    assert record["outcome"] == "cancelled: still pending when the run ended", record
    assert record["job_id"] not in cluster.queue()
    assert cluster.final_job_states(record["job_id"]) == ["CANCELLED"], cluster.job_states(record["job_id"])


def test_replicas_of_two_ranks_a_node_down_takes_one_replica_and_the_run_goes_on(cluster: SlurmCluster,
                                                                                     local_runs: Path, tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """2 x S2: a replica's two ranks share a node (n1: replica 0, n2: replica 1). Replica 1's leader
    sets n2 DOWN at step 2: Slurm ends both of its ranks, and replica 0 trains on alone."""
    from recover.experiments import grids as E
    from recover.experiments.launch_submitit import SlurmOptions, submit_grid

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=STEPS, shard=2)
    spec = next(r for r in grid.runs if r.label == "recover")
    spec.plan = {"faults": [{"kind": "node_down", "replica": 1, "step": 2, "phase": "backward"}]}
    grid.runs = [spec]
    opts = SlurmOptions(tasks_per_node=2, cpus_per_task=1, time_min=10, poll_s=1.0)
    out = submit_grid(grid, "slurm", root=tmp_path / "results", folder=tmp_path / "submitit", slurm=opts)
    assert [o.status for o in out] == ["submitted", "ok"], out
    run = spec.out_dir(tmp_path / "results")
    config, metrics, summary = load_run(run)
    assert config["train"]["shard"] == 2
    job = summary["slurm_job"]
    assert cluster.job_nodes(job) == "n[1-2]", cluster.job_nodes(job)
    assert cluster.node_state("n2").startswith("down"), cluster.node_state("n2")
    [fired] = assert_every_planned_fault_fired(run)
    assert fired["kind"] == "node_down" and fired["step"] == 2
    [recovery] = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "recovery"]
    assert (recovery["step"], recovery["survivors"]) == (2, [0]), recovery
    # Every step committed with the failure-free run's microbatches: both replicas until the
    # node went, then replica 0 alone.
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["members"] for m in metrics[:2]] == [[0, 1], [0, 1]] and metrics[-1]["members"] == [0], metrics
    for m in metrics:  # the ids the members' own ledgers name
        assert reported_ids(m) == iteration_ids(m["step"], config["train"]["microbatches"]), m
    reference = read_metrics(local_runs / "trajectory" / "failure-free_s0" / "metrics.jsonl")
    # S2 against one rank per replica: the same sums in another order (rel 1e-4, as locally)
    assert losses(run) == pytest.approx([m["loss"] for m in reference], rel=1e-4)


# 2 x S2 only: a one-rank replica's replacement is the worker-killed test's, and its node's
# loss the node_down test's; this one adds the node's return and the heal rank to rank.
@pytest.mark.parametrize("shard", [2])
def test_with_replace_after_a_replica_lost_with_its_node_is_replaced_when_the_node_returns(
        cluster: SlurmCluster, local_runs: Path, tmp_path: Path, monkeypatch, shard: int) -> None:
    """--replace-after on Slurm, at 2 x S2 (or S=1): replica 1's leader sets its node (n2)
    DOWN at step 1; task 0 submits a one-node replacement job for replica 1, which stays pending
    while n2 is down (n1 is the run's); n2 returns, Slurm starts it there, its ranks join as
    newcomers, are healed, and the run ends at full strength (--min-replicas 2 holds step 2 for them)."""
    from recover.experiments import grids as E
    from recover.experiments.launch_submitit import SlurmOptions, _wait_slurm, submit_grid

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=STEPS,
                        shard=shard if shard > 1 else None)
    spec = next(r for r in grid.runs if r.label == "recover")
    spec.plan = {"faults": [{"kind": "node_down", "replica": 1, "step": 1, "phase": "backward"}]}
    spec.overrides.update(replace_after=1.0, min_replicas=2)
    grid.runs = [spec]
    opts = SlurmOptions(tasks_per_node=shard, cpus_per_task=1, time_min=10, poll_s=1.0)
    [submitted] = submit_grid(grid, "slurm", root=tmp_path / "results", folder=tmp_path / "submitit", slurm=opts,
                              wait=False)
    job = submitted.detail.split()[1].rstrip(";")
    end = time.monotonic() + 120
    # the replacement job is queued while n2 is down, and cannot start: n1 holds the run's replica 0
    while not [j for j in cluster.queue() if j != job]:
        assert time.monotonic() < end, (cluster.queue(), cluster.node_state("n2"))
        time.sleep(0.5)
    [replacement] = [j for j in cluster.queue() if j != job]
    assert cluster.node_state("n2").startswith("down") and cluster.job_state(replacement) == "PENDING"
    cluster.resume("n2")  # the node is repaired
    import submitit
    sjob = submitit.SlurmExecutor(folder=tmp_path / "submitit").job_class(tmp_path / "submitit", job, tasks=[0, 1])
    outcome = _wait_slurm(spec.name, sjob, opts)
    assert outcome.status == "ok", outcome
    run = spec.out_dir(tmp_path / "results")
    config, metrics, summary = load_run(run)
    assert config["train"]["shard"] == shard
    [fired] = assert_every_planned_fault_fired(run)
    assert fired["kind"] == "node_down" and fired["step"] == 1
    # Slurm's account: the run's job lost n2, the replacement job ran there and has left the queue
    assert cluster.job_nodes(summary["slurm_job"]) == "n[1-2]"
    assert len(summary["replacements"]) == 1, summary["replacements"]  # (what became of each, if not one)
    [record] = summary["replacements"]
    assert (record["replica"], record["incarnation"], record["job_id"]) == (1, 1, replacement), record
    assert record["started_at"] is not None and record["outcome"].startswith("ran to the run's end"), record
    assert cluster.job_nodes(replacement) == "n2"
    assert cluster.final_job_states(replacement)[-1] in ("COMPLETED", "CANCELLED"), cluster.job_states(replacement)
    assert replacement not in cluster.queue()
    # From the workers' reports: the newcomer was admitted with the live state and healed ...
    events = read_jsonl(run / "events.jsonl")
    [recovery] = [e for e in events if e["kind"] == "recovery"]
    assert (recovery["step"], recovery["survivors"]) == (1, [0]), recovery
    [join] = [e for e in events if e["kind"] == "join"]
    assert (join["replica"], join["why"], join["donor"]) == (1, "replacement", 0), join
    assert join["pid"] != fired["pid"]
    assert set(join["member_digests"]) == {"0", "1"} and set(join["member_digests"].values()) == {join["weights_digest"]}
    if shard > 1:  # rank to rank: each position its own shard
        assert len(set(join["shard_fingerprints"][str(i)] for i in range(shard))) == shard, join
    # ... and the last steps were folded by every replica, every step with the failure-free ids
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["members"] for m in metrics[:2]] == [[0, 1], [0]], metrics
    assert join["first_commit_step"] == 2
    assert all(m["members"] == [0, 1] for m in metrics[2:]), metrics
    for m in metrics:  # the ids the members' own ledgers name
        assert reported_ids(m) == iteration_ids(m["step"], config["train"]["microbatches"]), m
    finals = summary["final_checksums"]  # each finisher's own final file
    assert sorted(finals) == ["0", "1"] and len(set(finals.values())) == 1, finals
    reference = read_metrics(local_runs / "trajectory" / "failure-free_s0" / "metrics.jsonl")
    assert losses(run) == pytest.approx([m["loss"] for m in reference], rel=REL if shard == 1 else 1e-4)


def test_with_replace_after_a_replica_whose_worker_was_killed_is_replaced_on_its_own_node(
        cluster: SlurmCluster, tmp_path: Path, monkeypatch) -> None:
    """Replica 1's worker SIGKILLs itself at step 1; its node (n2) stays in the run's job. Task 1
    reports the exit, task 0 submits a replacement job that may use n2 (no live replica there; this
    cluster shares nodes), whose rank joins and is healed: the run ends at full strength."""
    from recover.experiments import grids as E
    from recover.experiments.launch_submitit import SlurmOptions, submit_grid

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    grid = E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=STEPS,
                        recover={"replace_after": 0.0, "min_replicas": 2})
    spec = next(r for r in grid.runs if r.label == "recover")
    spec.plan = {"faults": [{"kind": "crash", "replica": 1, "step": 1, "phase": "backward"}]}
    grid.runs = [spec]
    opts = SlurmOptions(tasks_per_node=1, cpus_per_task=1, time_min=10, poll_s=0.5)
    out = submit_grid(grid, "slurm", root=tmp_path / "results", folder=tmp_path / "submitit", slurm=opts)
    assert [o.status for o in out] == ["submitted", "ok"], out
    run = spec.out_dir(tmp_path / "results")
    config, metrics, summary = load_run(run)
    [fired] = assert_every_planned_fault_fired(run)
    assert fired["kind"] == "crash" and fired["step"] == 1
    assert len(summary["replacements"]) == 1, summary["replacements"]  # (what became of each, if not one)
    [record] = summary["replacements"]
    assert (record["replica"], record["incarnation"]) == (1, 1) and record["started_at"] is not None, record
    assert cluster.job_nodes(record["job_id"]) == "n2" and record["job_id"] not in cluster.queue()
    [join] = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "join"]
    assert (join["replica"], join["why"], join["first_commit_step"]) == (1, "replacement", 2), join
    assert join["pid"] != fired["pid"]
    assert [m["members"] for m in metrics] == [[0, 1], [0], [0, 1], [0, 1]], metrics
    for m in metrics:
        assert reported_ids(m) == iteration_ids(m["step"], config["train"]["microbatches"]), m
    finals = summary["final_checksums"]
    assert sorted(finals) == ["0", "1"] and len(set(finals.values())) == 1, finals


def test_a_replacement_job_that_can_never_start_is_one_line_and_nothing_is_left_queued(
        cluster: SlurmCluster, tmp_path: Path, monkeypatch, capsys) -> None:
    """Task 0's replacer, on the real cluster: replica 1's task reported its worker SIGKILLed; the
    replacement job it submits asks for more CPUs than a node has, so Slurm keeps it pending for
    PartitionConfig. The replacer cancels it, says so in one line, and gives the slot up."""
    from recover.experiments import grids as E
    from recover.experiments.launch_submitit import SlurmTask, replacement_task
    from recover.experiments.slurm_replacements import ReplaceOptions, SlurmReplacements

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    [spec] = [r for r in E.build_grid("trajectory", seeds=[0], systems=["recover"], replicas=2, steps=STEPS).runs
              if r.label == "recover"]
    root = tmp_path / "results"
    task = SlurmTask(rank=0, job_id="999999", host0="n1", restart=0, spec=spec, out=spec.out_dir(root),
                     ranks_per_replica=1)
    task.sync.mkdir(parents=True)
    (task.sync / "done-1").write_text("-9")  # what replica 1's task writes when its worker is SIGKILLed
    opts = ReplaceOptions(folder=str(tmp_path / "submitit"), poll_s=0.2,
                          params={"name": "recover-never", "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 64,
                                  "timeout_min": 10})
    replacer = SlurmReplacements(task, str(root), opts, replace_after=0.0, reconnect_timeout=5.0, t0=time.time(),
                                  task_body=replacement_task)
    replacer.start()
    end = time.monotonic() + 60
    while not (replacer.jobs and replacer.jobs[0].outcome):
        assert time.monotonic() < end, replacer.record()
        time.sleep(0.2)
    replacer.close()
    [job] = replacer.record()
    assert job["replica"] == 1 and job["started_at"] is None, job
    assert job["outcome"] == "cannot start: pending for a reason that will not pass (PartitionConfig); cancelled"
    said = [line for line in capsys.readouterr().err.splitlines() if "cannot start" in line]
    assert len(said) == 1 and f"replacement job {job['job_id']} cannot start" in said[0], said
    assert "the run goes on without it" in said[0]
    assert job["job_id"] not in cluster.queue()
    assert 1 not in replacer._due  # given up: no second job for the slot


@pytest.mark.parametrize("bad, says", [
    # sbatch refuses it: nothing is queued
    (["--partition", "nosuch"], ["sbatch refused the job", "invalid partition", ".submission_file_"]),
    # queued, but no node of the partition has 64 CPUs: Slurm keeps it pending for PartitionConfig
    (["--cpus-per-task", "64"], ["cannot start", "(partitionconfig)", "cancelled", "_submission.sh", "log"]),
])
def test_a_job_that_cannot_run_is_one_clear_error_at_once(cluster: SlurmCluster, tmp_path: Path, bad, says) -> None:
    args = [*SLURM, "--cpus-per-task", "1", *bad]
    proc = recover_cli("experiment", *GRID, *args, "--out", str(tmp_path / "results"),
                       "--logs", str(tmp_path / "logs"), "--folder", str(tmp_path / "submitit"), env=cluster.env,
                       timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 5, proc.stdout  # every run of the grid, each one line
    for line in failed:
        assert all(w.lower() in line.lower() for w in says), line
    assert not cluster.queue()


def test_a_node_set_down_requeues_checkpoint_restart_which_resumes(cluster: SlurmCluster, local_runs: Path,
                                                                   tmp_path: Path, monkeypatch) -> None:
    """checkpoint-restart's replica 1 sets its node (n2) DOWN at step 3: its job is requeued, waits for a
    node, and once n2 is back (as a repaired node comes back) resumes from the step-2 checkpoint."""
    from recover.experiments import grids as E
    from recover.experiments.launch_submitit import SlurmOptions, _wait_slurm, submit_grid

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    grid = E.build_grid("trajectory", seeds=[0], systems=["ckpt-restart"], replicas=2, steps=STEPS,
                        baseline={"ckpt_every": 2, "restart_mode": "replace"})
    spec = next(r for r in grid.runs if r.label == "ckpt-restart")
    spec.plan = {"faults": [{"kind": "node_down", "replica": 1, "step": 3, "phase": "forward"}]}
    grid.runs = [spec]
    opts = SlurmOptions(tasks_per_node=1, cpus_per_task=1, time_min=10, poll_s=1.0)
    [submitted] = submit_grid(grid, "slurm", root=tmp_path / "results", folder=tmp_path / "submitit", slurm=opts,
                              wait=False)
    job = submitted.detail.split()[1].rstrip(";")
    end = time.monotonic() + 120
    # requeued (by its task 0, once its rank 0 saw the collective break) while n2 is still down
    while not (cluster.job_state(job) == "PENDING" and cluster.restarts(job) >= 1):
        assert time.monotonic() < end, (cluster.job_state(job), cluster.restarts(job), cluster.node_state("n2"))
        time.sleep(0.5)
    assert cluster.node_state("n2").startswith("down")
    cluster.resume("n2")  # the node is repaired only after the job left it
    import submitit
    sjob = submitit.SlurmExecutor(folder=tmp_path / "submitit").job_class(tmp_path / "submitit", job, tasks=[0, 1])
    said: list[str] = []
    outcome = _wait_slurm(spec.name, sjob, opts, echo=said.append)
    assert outcome.status == "ok", outcome
    # Slurm held the requeued job (reason BeginTime) and the waiting submitter started it
    assert said == [f"  job {job} requeued (restart 1): started now, not after Slurm's 120 s hold"], said
    run = spec.out_dir(tmp_path / "results")
    _, metrics, summary = load_run(run)
    [restart] = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "restart"]
    assert summary["restarts"] == 1 and restart["from_step"] == 2 and restart["members"] == [0, 1], restart
    assert restart["failed_replicas"] == [1] and "replica 1 gone" in restart["fault"], restart  # gone with n2
    assert_close(losses(run), losses(local_runs / "trajectory" / "failure-free_s0"))
