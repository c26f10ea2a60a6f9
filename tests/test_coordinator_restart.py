"""The coordinator can die: real SIGKILL and SIGSTOP of the coordinator process.

Real processes, gloo, the tiny model, 3 replicas. The coordinator is killed by its
PID in the middle of an iteration (a worker pulls a `coordinator_crash` trigger
at its step and phase, or the test kills it from outside after some commits),
in the middle of a commit (the coordinator kills itself right after sending the
step's commit to replica 0 only, or to every member: `commit_sent`; mid-run and at
the last step, where the workers that heard it wait for `done`), during start-up, or frozen for good
(`coordinator_hang`: the launcher sees it stop beating and kills it). Each time
the launcher restarts it on the same ports, the workers reconnect with their
state, and the new coordinator rebuilds the run from their reports.

Checked from what the workers reported: every step is committed exactly once
(metrics.jsonl), its ledgers are exactly its M ids, its loss equals the
failure-free run's to 1e-5, every replica finishes with the same weights, the
coordinator's exit is recorded as killed and restarted, and events.jsonl says
what the rebuild did (for mid-commit: the members that missed the commit heard
it from the new coordinator, and the line the old one never wrote was written
from the reported votes). Without restarts, the run fails saying why.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import (USER_LOOP, assert_every_planned_fault_fired, load_run, run_recover, run_recover_killing,
                      user_loop_committed_every_step)

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs

R, M, STEPS, SEED = 3, 6, 8, 3
LOSS_RTOL = 1e-5  # summation order only; one id lost or doubled moves the loss by > 1e-3
COMMON = ["--replicas", str(R), "--microbatches", str(M), "--steps", str(STEPS), "--seed", str(SEED),
          "--collective-timeout", "20", "--no-progress"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[float], float]:
    """Failure-free losses and final weights checksum."""
    out = tmp_path_factory.mktemp("ref") / "plain"
    run_recover("train", "--system", "plain", *COMMON, "--out", str(out), check=True, timeout=120)
    _, metrics, summary = load_run(out)
    return [m["loss"] for m in metrics], summary["weights_checksum"]


def _run(tmp_path: Path, faults: list[dict], *extra: str, ok: bool = True):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": faults}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *COMMON, *extra, "--faults", str(plan), "--out", str(out),
                       timeout=180)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    return out, proc


def _assert_same_run(out: Path, reference: tuple[list[float], float]) -> tuple[list[dict], dict]:
    losses, checksum = reference
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == list(range(STEPS))  # each step once, none lost
    for m, ref in zip(metrics, losses):
        assert reported_ids(m) == iteration_ids(m["step"], M)  # what the members' votes said they folded
        assert abs(m["loss"] - ref) <= LOSS_RTOL * abs(ref), (m["step"], m["loss"], ref)
    sums = summary["final_checksums"]
    assert sorted(sums) == [str(r) for r in range(R)] and len(set(sums.values())) == 1, sums
    assert abs(summary["weights_checksum"] - checksum) <= 1e-6 * abs(checksum)
    return metrics, summary


def _coordinator_exits(summary: dict) -> list[dict]:
    return [p for p in summary["processes"] if p["role"] == "coordinator"]


def _seconds_to_next_commit(metrics: list[dict], fired: dict) -> float:
    """From a fault's record to the commit of the step it struck (the previous step's line can be
    written after a fault early in the next step: the coordinator sends commits before it records)."""
    return min(m["wall_time"] for m in metrics if m["step"] >= fired["step"]) - fired["wall_time"]


def test_a_coordinator_killed_mid_iteration_is_restarted_and_the_run_is_unchanged(tmp_path, reference):
    # --reconnect-timeout far below any restart (a new process, its imports): under the launcher,
    # which restarts the coordinator or ends the job, the workers' reconnect has no fixed bound
    out, _ = _run(tmp_path, [{"kind": "coordinator_crash", "replica": 1, "step": 3, "phase": "backward"}],
                  "--reconnect-timeout", "0.05")
    (fired,) = assert_every_planned_fault_fired(out)
    for r in range(R):
        assert "until the launcher restarts it or ends the job" in (out / "logs" / f"replica{r}.log").read_text()
    metrics, summary = _assert_same_run(out, reference)
    first, last = _coordinator_exits(summary)
    assert first["pid"] == fired["pid"] and first["how"] == "killed by SIGKILL" and first["restarted"]
    assert last["returncode"] == 0 and not last["restarted"]
    (rebuilt,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "rebuilt"]
    assert rebuilt["step"] == 3 and rebuilt["members"] == [0, 1, 2] and rebuilt["missed_commit"] == []
    assert rebuilt["at"] - fired["wall_time"] > 0.05  # the reconnects outlived --reconnect-timeout
    assert metrics[3]["generation"] == rebuilt["generation"]
    # the workers kept their state: nobody was closed or healed from a donor
    assert rebuilt["closed"] == [] and not [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "join"]
    print(f"coordinator kill -> next commit: {_seconds_to_next_commit(metrics, fired):.2f}s")


@pytest.mark.parametrize("step,last_sent_to,missed", [(4, 0, [1, 2]), (4, 2, []), (STEPS - 1, 0, [1, 2]),
                                                     (STEPS - 1, 2, [])],
                         ids=["to-replica-0-only", "to-every-member", "last-step-to-replica-0-only",
                              "last-step-to-every-member"])
def test_a_coordinator_killed_mid_commit_tells_the_members_that_missed_it(tmp_path, reference, step, last_sent_to,
                                                                          missed):
    # The old coordinator sent the step's commit to replica `last_sent_to` (and those before it), then
    # died (SIGKILL of itself) before writing its line. Sent to every member (replica 2 is the
    # last): the members went on, and their reports carry the vote they committed. At the last
    # step the members that heard it have finished: they stay for `done`, so the restarted
    # coordinator has them to ask, writes the line and ends the run without a generation.
    out, _ = _run(tmp_path, [{"kind": "coordinator_crash", "replica": last_sent_to, "step": step,
                              "phase": "commit_sent"}])
    (fired,) = assert_every_planned_fault_fired(out)
    assert fired["fired_by"] == "coordinator"
    metrics, summary = _assert_same_run(out, reference)
    (rebuilt,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "rebuilt"]
    assert rebuilt["step"] == step + 1 and rebuilt["missed_commit"] == missed and rebuilt["members"] == [0, 1, 2]
    assert rebuilt.get("finished", False) is (step == STEPS - 1)
    # the old coordinator sends before it records: the step's line came from the workers' votes
    assert metrics[step].get("rebuilt") is True and metrics[step]["complete"] is True
    assert sorted(map(int, metrics[step]["ledgers"])) == [0, 1, 2]
    assert [p["how"] for p in _coordinator_exits(summary)] == ["killed by SIGKILL", "exited 0"]


def test_a_frozen_coordinator_is_killed_and_restarted(tmp_path, reference):
    out, proc = _run(tmp_path, [{"kind": "coordinator_hang", "replica": 2, "step": 2, "phase": "forward"}],
                     "--coordinator-timeout", "2")
    (fired,) = assert_every_planned_fault_fired(out)
    metrics, summary = _assert_same_run(out, reference)
    first, last = _coordinator_exits(summary)
    assert first["pid"] == fired["pid"] and first["how"] == "killed by SIGKILL" and first["restarted"]
    assert last["returncode"] == 0
    # found by its silence (a frozen process never exits: nothing else would have told the launcher)
    assert f"coordinator (pid {fired['pid']}) silent for" in proc.stderr and "frozen" in proc.stderr
    print(f"coordinator freeze -> next commit: {_seconds_to_next_commit(metrics, fired):.2f}s")


def test_a_coordinator_killed_from_outside_after_some_commits(tmp_path, reference):
    out = tmp_path / "run"
    proc, victim = run_recover_killing(["train", "--system", "recover", *COMMON, "--out", str(out)], out,
                                       replica=-1, after_commits=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, summary = _assert_same_run(out, reference)
    first, _ = _coordinator_exits(summary)
    assert first["pid"] == victim and first["how"] == "killed by SIGKILL" and first["restarted"]


def test_a_coordinator_killed_during_start_up_is_restarted_and_start_up_goes_on(tmp_path, reference):
    # Killed as soon as the launcher names its PID: before generation 0 (the workers are still
    # importing, or saying hello). Whichever it was, the run must go on unchanged.
    out = tmp_path / "run"
    proc, victim = run_recover_killing(["train", "--system", "recover", *COMMON, "--out", str(out)], out,
                                       replica=-1, after_commits=0)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    _, summary = _assert_same_run(out, reference)
    first, _ = _coordinator_exits(summary)
    assert first["pid"] == victim and first["restarted"]


def test_without_restarts_a_killed_coordinator_ends_the_run_saying_so(tmp_path):
    out, proc = _run(tmp_path, [{"kind": "coordinator_crash", "replica": 0, "step": 2, "phase": "forward"}],
                     "--coordinator-restarts", "0", ok=False)
    assert proc.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "coordinator killed by SIGKILL" in summary["reason"], summary
    assert [p["restarted"] for p in _coordinator_exits(summary)] == [False]
    assert all(p["returncode"] is not None for p in summary["processes"])  # nothing left running


def test_recover_launch_restarts_the_coordinator_of_a_users_loop(tmp_path):
    """`recover launch`: a user's own loop (examples/user_loop.py, Replica.from_env) keeps its
    state across a coordinator SIGKILL; every step is committed once, with its M ids and the
    schedule's rate (a worker that lost its place would report another rate, or be refused)."""
    import sys

    example = USER_LOOP
    # long enough that the kill after 4 commits lands mid-run: the loop commits a step in ~3 ms, and
    # a kill after the last commit meets workers that have finished (they wait for `done`)
    out, steps = tmp_path / "launch", 60
    proc, victim = run_recover_killing(
        ["launch", "--replicas", "2", "--microbatches", "4", "--steps", str(steps), "--out", str(out), "--",
         sys.executable, example], out, replica=-1, after_commits=4, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    user_loop_committed_every_step(out, steps, 4)
    (rebuilt,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "rebuilt"]
    assert rebuilt["members"] == [0, 1] and rebuilt["closed"] == []
    exits = [p for p in json.loads((out / "summary.json").read_text())["processes"] if p["role"] == "coordinator"]
    assert [(p["pid"] == victim, p["how"], p["restarted"]) for p in exits] == [
        (True, "killed by SIGKILL", True), (False, "exited 0", False)]


def test_a_replacement_waiting_for_admission_survives_a_coordinator_kill_and_is_admitted(tmp_path, reference):
    """Replica 2 is SIGKILLed at step 1 and replaced a second later; the moment the
    coordinator's log says the replacement waits for admission, the coordinator is SIGKILLed by its
    PID. The restarted one keeps the replacement waiting (it used to close it, and the replacement
    exited, code 1) and admits it at its next commit: one replacement process, which finishes with
    the others, at full strength, on the failure-free trajectory. The survivors are paced (each
    microbatch lasts 1 s from step 1 on) so that a step outlasts the test's reaction to the log line:
    the replacement is still waiting when the kill lands."""
    import os
    import signal
    import subprocess
    import sys
    import time

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 2, "step": 1, "phase": "forward", "microbatch": 0},
        *({"kind": "pace", "replica": r, "step": 1, "phase": "forward", "seconds": 1.0} for r in (0, 1))]}))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "recover.experiments.cli", "train", "--system", "recover",
                             *COMMON, "--replace-after", "1", "--faults", str(plan), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "logs" / "coordinator.log"
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and "waits for admission" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        victim = json.loads((out / "pids.json").read_text())["coordinator"]
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout + stderr + log.read_text()
    assert_every_planned_fault_fired(out)
    metrics, summary = _assert_same_run(out, reference)
    first, last = _coordinator_exits(summary)
    assert first["pid"] == victim and first["how"] == "killed by SIGKILL" and first["restarted"]
    assert last["returncode"] == 0
    # one replacement process, which finished (the old code closed it at the rebuild: it exited 1,
    # and only a second replacement brought the run back to full strength)
    twos = [p for p in summary["processes"] if p["role"] == "worker" and p["replica"] == 2]
    assert [p["how"] for p in twos] == ["killed by SIGKILL", "exited 0"], twos
    events = read_jsonl(out / "events.jsonl")
    (rebuilt,) = [e for e in events if e["kind"] == "rebuilt"]
    assert rebuilt["newcomers"] == [2] and rebuilt["closed"] == [] and rebuilt["members"] == [0, 1]
    # admitted by the restarted coordinator (the kill landed while it waited), healed, one process
    (admitted,) = [e for e in events if e["kind"] == "admitted"]
    assert events.index(admitted) > events.index(rebuilt) and admitted["replicas"] == [2]
    (join,) = [e for e in events if e["kind"] == "join"]
    assert join["replica"] == 2 and join["why"] == "replacement" and join["pid"] == twos[1]["pid"]
    assert set(join["member_digests"].values()) == {join["weights_digest"]}
    assert all(m["members"] == [0, 1, 2] for m in metrics if m["step"] >= join["first_commit_step"])
    assert metrics[-1]["members"] == [0, 1, 2]


def test_a_restart_during_work_slower_than_the_collective_timeout_waits_for_the_reports(tmp_path):
    # Every microbatch paced to 4 s against a 1 s collective timeout; the coordinator is killed
    # in step 1 (step 0's line recorded the members' measured gap). Each worker's training thread notices only after its microbatch, seconds later:
    # a restarted coordinator that waited the collective timeout for the reports found none
    # ("no member of it reported", exit 1). It now waits four of the longest gaps the members
    # measured, as the last metrics line records them.
    r, m, steps = 3, 3, 3
    common = ["--replicas", str(r), "--microbatches", str(m), "--steps", str(steps)]
    ref = tmp_path / "ref"
    run_recover("train", "--system", "plain", *common, "--out", str(ref), "--no-progress", check=True, timeout=120)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        *({"kind": "pace", "replica": x, "step": 0, "phase": "forward", "seconds": 4.0} for x in range(r)),
        {"kind": "coordinator_crash", "replica": 1, "step": 1, "phase": "forward"}]}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *common, "--collective-timeout", "1", "--faults", str(plan),
                       "--out", str(out), "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    _, metrics, _ = load_run(out)
    assert [x["step"] for x in metrics] == list(range(steps))
    assert all(reported_ids(x) == iteration_ids(x["step"], m) for x in metrics)
    assert metrics[-1]["members"] == [0, 1, 2]  # nobody lost: the restart cost no replica
    rebuilt = [e for e in read_jsonl(out / "events.jsonl") if e.get("kind") == "rebuilt"]
    assert rebuilt, "the coordinator was not restarted"
    # each report came from the worker's heartbeat thread, mid-microbatch, not from its training
    # thread at the end of the 4 s microbatch
    for x in range(r):
        log = (out / "logs" / f"replica{x}.log").read_text()
        assert "its restart took this replica's report from the heartbeat thread" in log, log
    for x, y in zip(metrics, read_metrics(ref / "metrics.jsonl")):
        assert x["loss"] == pytest.approx(y["loss"], rel=LOSS_RTOL)
