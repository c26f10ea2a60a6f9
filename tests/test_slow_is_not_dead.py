"""Slow is not dead, with real workers: quotas far longer than the collective
timeout, and a straggler, cost no replica; only a real fault does.

`pace` (a floor on each microbatch's time) rather than `slow`, so the quotas' length
does not depend on this machine's load.
"""
from __future__ import annotations

import json

import pytest

from conftest import load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs

REPLICAS, MICROBATCHES, STEPS = 4, 8, 6


def _plan(tmp_path, faults: list[dict]):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": faults}))
    return str(path)


def _pace(seconds: dict[int, float]) -> list[dict]:
    return [{"kind": "pace", "replica": r, "step": 0, "phase": "forward", "seconds": s} for r, s in seconds.items()]


def _train_every_step(out_dir, plan: str, collective_timeout: str, failure_free=None):
    """recover at the module's layout under `plan`: it ends well with every step, each with its M ids
    as the workers' ledgers report them, and (given `failure_free`) each on the failure-free loss."""
    proc = run_recover("train", "--system", "recover", "--replicas", str(REPLICAS), "--microbatches",
                       str(MICROBATCHES), "--steps", str(STEPS), "--collective-timeout", collective_timeout,
                       "--faults", plan, "--out", str(out_dir), "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, metrics, summary = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(reported_ids(m) == iteration_ids(m["step"], MICROBATCHES) for m in metrics)  # the workers' ledgers
    for m, ref in zip(metrics, failure_free or []):
        assert m["loss"] == pytest.approx(ref, rel=1e-5)
    return metrics, summary, proc


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "run"
    run_recover("train", "--system", "plain", "--replicas", str(REPLICAS), "--microbatches", str(MICROBATCHES),
                "--steps", str(STEPS), "--out", str(out), "--no-progress", check=True)
    return [m["loss"] for m in read_metrics(out / "metrics.jsonl")]


def test_quotas_three_times_the_collective_timeout_lose_only_the_crashed_replica(tmp_path, out_dir, failure_free):
    # 2 microbatches of 1.5 s each: a quota is 3 s against a 1 s collective timeout
    plan = _plan(tmp_path, _pace({r: 1.5 for r in range(REPLICAS)})
                 + [{"kind": "crash", "replica": 1, "step": 3, "phase": "forward"}])
    metrics, summary, proc = _train_every_step(out_dir, plan, "1", failure_free)
    assert summary["status"] == "ok"
    assert metrics[-1]["members"] == [0, 2, 3]
    events = read_jsonl(out_dir / "events.jsonl")
    recoveries = [e for e in events if e["kind"] == "recovery"]
    # the crash is the run's only recovery: no timed-out rendezvous or all-reduce, no one removed for slowness
    assert len(recoveries) == 1 and recoveries[0]["step"] == 3, recoveries
    assert recoveries[0]["faults"] == ["replica 1 lost: control connection closed (process gone)"]
    assert "timed out" not in proc.stderr


def test_a_straggler_ten_times_slower_is_not_ejected_and_its_quota_shrinks(tmp_path, out_dir):
    # replica 2's microbatch 0.5 s, the others' 0.05 s: its quota of 2 is 1 s, twice the collective timeout
    steps, microbatches = 10, 16
    plan = _plan(tmp_path, _pace({0: 0.05, 1: 0.05, 2: 0.5, 3: 0.05}))
    proc = run_recover("train", "--system", "recover", "--replicas", str(REPLICAS), "--microbatches",
                       str(microbatches), "--steps", str(steps), "--collective-timeout", "0.5", "--faults", plan,
                       "--out", str(out_dir), "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, metrics, _ = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["members"] == [0, 1, 2, 3] and m["generation"] == 0 for m in metrics)
    events = read_jsonl(out_dir / "events.jsonl")
    assert not [e for e in events if e["kind"] in ("recovery", "fenced")], events
    # the policy moved work off the straggler (by its measured speed), without ejecting it
    assert metrics[0]["folded"]["2"] == microbatches // REPLICAS
    assert metrics[-1]["folded"]["2"] < microbatches // REPLICAS
    assert metrics[-1]["folded"]["0"] > microbatches // REPLICAS


def test_a_member_stuck_between_its_all_reduce_and_its_vote_is_fenced_and_the_step_commits(tmp_path, out_dir,
                                                                                             failure_free):
    # replica 2's training thread blocks after step 2's all-reduce (its heartbeat thread beats on);
    # nothing else would ever end that step: every other member voted and waits for the commit
    plan = _plan(tmp_path, [{"kind": "stall", "replica": 2, "step": 2, "phase": "vote", "seconds": 60}])
    metrics, _, _ = _train_every_step(out_dir, plan, "2", failure_free)
    assert metrics[2]["members"] == [0, 1, 3]
    [rec] = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    assert rec["step"] == 2 and "replica 2 lost: did not vote for step 2" in rec["fault"], rec
    # fenced at the vote deadline (the collective timeout plus four times what the others took from
    # go to their votes: milliseconds here, so the bound leaves room for a loaded machine), long
    # before the stall would end (60 s) or the others would give up waiting (3 x 2 + 60 s)
    [fired] = [json.loads(line) for line in (out_dir / "faults.jsonl").read_text().splitlines()]
    assert 2 <= rec["detected_at"] - fired["wall_time"] < 15, (rec, fired)


def test_members_stuck_at_any_phase_before_ready_are_fenced_by_their_own_measured_progress(tmp_path, out_dir,
                                                                                            failure_free):
    # Three training threads block for good (heartbeats on), each at another phase that precedes
    # `ready`: in a backward, after its vote (before the commit is known), and after the commit
    # (before the optimizer step, a device sync that never returns). Nothing but the progress rule
    # ends any of these: the others said `ready` and wait for `go`, which never comes.
    plan = _plan(tmp_path, [{"kind": "stall", "replica": 1, "step": 1, "phase": "backward", "microbatch": 1},
                            {"kind": "stall", "replica": 2, "step": 2, "phase": "commit"},
                            {"kind": "stall", "replica": 3, "step": 3, "phase": "optimizer_step"}])
    metrics, _, _ = _train_every_step(out_dir, plan, "2", failure_free)
    assert metrics[-1]["members"] == [0]
    fired = {f["replica"]: f for f in read_jsonl(out_dir / "faults.jsonl")}
    assert sorted(fired) == [1, 2, 3]
    recoveries = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    # one recovery per stall, each naming the stalled replica and the progress rule, nothing else
    assert [len(e["faults"]) for e in recoveries] == [1, 1, 1], recoveries
    for e, r in zip(recoveries, (1, 2, 3)):
        assert e["fault"].startswith(f"replica {r} lost: no progress for "), e
        # within its bound (2 s plus four of its gaps plus two beats) of the stall, give or take a loaded machine
        assert 2 <= e["detected_at"] - fired[r]["wall_time"] < 20, (e, fired[r])
