"""`--exact` on real processes: bit-identical trajectories whatever replicas fold or die.

The reference is the plain trainer on one replica. Every other run must give the same
loss at every step and the same sha256 of the final weights, bit for bit (== on the
floats, not a tolerance): plain on 4 replicas (another partition of every step's ids,
another reduction), recover on 4 replicas losing 2 to real SIGKILLs mid-step (one in
a microbatch's backward, one while the all-reduce is in flight), whose ids the survivors
redo, recover on 8 replicas with a straggler and a kill during the recovery, recover
healing a replacement and a rejoined frozen replica through the state transfer, recover
whose coordinator is killed mid-commit and rebuilt, and checkpoint-restart on 2 replicas restarted on the 1 left from its checkpoint. An
gradient spike (the grad_spike fault kind, a test hook that multiplies one microbatch's
gradient) beyond the normal range goes to the wide sums and the trajectory stays
bit-identical; one beyond those too is never committed: plain stops naming the step, recover stops
naming the step and the microbatch (--on-nonfinite stop) or skips that step on every
replica alike (--on-nonfinite skip), which keeps the trajectory the same across partitions.
The control: without --exact, plain on 1 and on 4 replicas end with different weights.

Budget: 16 runs of the tiny model, 4 steps each: ~75 s on two quiet cores (with
test_exact_accumulation.py, ~2 min beside `stress-ng --cpu 2`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import reported_ids

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

M, STEPS, SEED = 8, 4, 5
COMMON = ["--microbatches", str(M), "--steps", str(STEPS), "--seed", str(SEED), "--exact",
          "--heartbeat-timeout", "1.5", "--collective-timeout", "20", "--no-progress"]


def _run(out: Path, system: str, replicas: int, *extra: str, code: int = 0) -> tuple[list[float], set[str]]:
    proc = run_recover("train", "--system", system, "--replicas", str(replicas), *COMMON, *extra, "--out", str(out))
    logs = "".join(p.read_text() for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""
    assert proc.returncode == code, proc.stdout + proc.stderr + logs
    metrics = load_run(out)[1] if (out / "metrics.jsonl").exists() else []
    digests = {json.loads(f.read_text()).get("weights_digest") for f in (out / "final").glob("replica*.json")}
    return [m["loss"] for m in metrics], digests


def _plan(tmp_path: Path, faults: list[dict]) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": faults}))
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[float], str]:
    losses, digests = _run(tmp_path_factory.mktemp("ref") / "plain1", "plain", 1)
    assert len(losses) == STEPS and len(digests) == 1 and None not in digests
    return losses, digests.pop()


def test_plain_on_four_replicas_is_bit_identical_to_one(tmp_path, reference):
    losses, digests = _run(tmp_path / "plain4", "plain", 4)
    assert (losses, digests) == (reference[0], {reference[1]})


def test_without_exact_the_same_runs_differ_in_the_last_bits(tmp_path):
    # The control: what --exact removes. In fp32 mode, 1 and 4 replicas sum every step's
    # gradient in different orders, and the final weights differ (in their last bits).
    fp32 = [a for a in COMMON if a != "--exact"]
    digests = []
    for r in (1, 4):
        out = tmp_path / f"fp32_{r}"
        run_recover("train", "--system", "plain", "--replicas", str(r), *fp32, "--out", str(out), check=True)
        digests.append({json.loads(f.read_text())["weights_digest"] for f in (out / "final").glob("replica*.json")})
    assert len(digests[0]) == len(digests[1]) == 1 and digests[0] != digests[1]


def test_recover_losing_two_of_four_replicas_mid_step_is_bit_identical(tmp_path, reference):
    faults = [
        {"kind": "crash", "replica": 1, "step": 1, "phase": "backward", "microbatch": 1},
        {"kind": "crash", "replica": 2, "step": 2, "phase": "allreduce"},
    ]
    out = tmp_path / "recover"
    losses, digests = _run(out, "recover", 4, "--faults", _plan(tmp_path, faults))
    fired = assert_every_planned_fault_fired(out)
    assert [f["kind"] for f in fired] == ["crash", "crash"]
    _, metrics, summary = load_run(out)
    assert {(e["replica"], e["how"]) for e in summary["processes"]} >= {(1, "killed by SIGKILL"),
                                                                       (2, "killed by SIGKILL")}
    assert [sorted(m["members"]) for m in metrics][-1] == [0, 3]  # the survivors finished the run
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)
    assert losses == reference[0]  # every step's loss, bit for bit
    assert digests == {reference[1]}  # both survivors hold the failure-free weights, bit for bit


# id 16, step 2's first, is microbatch 0 of replica 0 on 1, 2 or 4 replicas (quotas are contiguous)
SPIKE = {"kind": "grad_spike", "step": 2, "phase": "backward", "microbatch": 0, "factor": 1e9}
HUGE = {**SPIKE, "factor": 1e30}  # beyond the wide sums' 2^42 too (and still finite in fp32)


def test_a_spike_goes_to_the_wide_sums_and_the_trajectory_stays_bit_identical(tmp_path):
    # x 1e9 puts id 16's gradient beyond 2^12: it goes to the wide sums, the run goes on, and
    # plain on 1 and recover on 4 (the spike folded by another replica count) agree bit for bit
    plan = _plan(tmp_path, [{**SPIKE, "replica": 0}])
    runs = [_run(tmp_path / "plain1", "plain", 1, "--faults", plan),
            _run(tmp_path / "recover4", "recover", 4, "--faults", plan)]
    assert runs[0] == runs[1] and len(runs[0][0]) == STEPS
    assert all("grad_spike (fault 0) at step 2" in (tmp_path / name / "logs" / "replica0.log").read_text()
               for name in ("plain1", "recover4"))


def test_plain_stops_at_an_out_of_range_gradient(tmp_path):
    out = tmp_path / "plain"
    _run(out, "plain", 2, "--faults", _plan(tmp_path, [{**HUGE, "replica": 1}]), code=1)
    losses = [m["loss"] for m in load_run(out)[1]]
    assert len(losses) == 2  # steps 0 and 1 committed, step 2 never
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "step 2:" in logs and "outside the fixed-point range" in logs


def test_recover_stops_naming_the_out_of_range_microbatch(tmp_path):
    out = tmp_path / "recover"
    # replica 1 of 2 folds ids 20..23 of step 2 (M=8): its first is id 20
    _run(out, "recover", 2, "--faults", _plan(tmp_path, [{**HUGE, "replica": 1}]), code=1)
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == [0, 1]
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "step 2: microbatch 20 is outside the exact fixed-point range" in logs
    assert "step 2" in summary["reason"] and "[20]" in summary["reason"]


def test_a_skipped_out_of_range_step_is_the_same_on_any_partition(tmp_path):
    # the spike hits id 16 (step 2's first id) in both runs, folded by replica 0 of 2 or of 4
    # (the launcher reports a run with a skipped step as failed, exit 1: "only 3 of 4 steps committed")
    runs = [_run(tmp_path / f"r{r}", "recover", r, "--on-nonfinite", "skip",
                 "--faults", _plan(tmp_path, [{**HUGE, "replica": 0}]), code=1) for r in (2, 4)]
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == STEPS - 1  # step 2 skipped: no metrics line, no update


def test_checkpoint_restart_resuming_on_fewer_replicas_is_bit_identical(tmp_path, reference):
    # replica 0 of 2 dies in step 3; the survivor restarts from the checkpoint of step 2 (written by two
    # replicas' commits) and folds all M ids of steps 2 and 3 alone: another partition, the same bits
    out = tmp_path / "ckpt"
    plan = _plan(tmp_path, [{"kind": "crash", "replica": 0, "step": 3, "phase": "backward"}])
    losses, _ = _run(out, "ckpt-restart", 2, "--checkpoint-every", "2", "--faults", plan)
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    assert summary["restarts"] == 1
    assert [m["generation"] for m in metrics] == [0, 0, 1, 1]  # steps 2 and 3 redone after the restart
    assert [m["members"] for m in metrics][-1] == [1]
    assert losses == reference[0]
    assert json.loads((out / "baseline" / "final.json").read_text())["weights_digest"] == reference[1]


def test_recover_on_eight_replicas_with_a_straggler_and_a_kill_during_recovery(tmp_path, reference):
    # Replica 5 is 3x slow from the start (its quota shrinks once measured); replica 1 dies in a
    # backward of step 1; replica 2 dies while the recovery generation's all-reduce is in flight
    # (it first reaches that point there: generation 0 of step 1 never got to its all-reduce).
    faults = [
        {"kind": "slow", "replica": 5, "step": 0, "phase": "forward", "factor": 3},
        {"kind": "crash", "replica": 1, "step": 1, "phase": "backward", "microbatch": 0},  # (M = R: one each)
        {"kind": "crash", "replica": 2, "step": 1, "phase": "allreduce"},
    ]
    out = tmp_path / "recover8"
    losses, digests = _run(out, "recover", 8, "--faults", _plan(tmp_path, faults))
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    assert {(e["replica"], e["how"]) for e in summary["processes"]} >= {(1, "killed by SIGKILL"),
                                                                       (2, "killed by SIGKILL")}
    step1 = metrics[1]
    assert step1["generation"] >= 2  # two recoveries inside step 1: the kill came during the first
    assert sorted(step1["members"]) == [0, 3, 4, 5, 6, 7]
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)
    assert losses == reference[0]
    assert digests == {reference[1]}  # all six survivors


def test_a_replacement_and_a_rejoined_frozen_replica_are_healed_into_the_same_bits(tmp_path, reference):
    # Replica 1 is SIGKILLed in step 1 and replaced (--replace-after); replica 2 is SIGSTOPped in
    # step 2 past the heartbeat deadline, declared dead, and rejoins once SIGCONTed. Both come back
    # through the state transfer (weights, AdamW state, schedule from a donor); --min-replicas 4
    # makes each next step wait for them. Every step and all four final digests are the reference's.
    faults = [
        {"kind": "crash", "replica": 1, "step": 1, "phase": "forward", "microbatch": 0},
        {"kind": "hang", "replica": 2, "step": 2, "phase": "backward", "microbatch": 0, "seconds": 3},
    ]
    out = tmp_path / "healed"
    losses, digests = _run(out, "recover", 4, "--replace-after", "0.2", "--min-replicas", "4",
                           "--faults", _plan(tmp_path, faults))
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    assert sorted(metrics[-1]["members"]) == [0, 1, 2, 3]  # back at full strength
    assert sorted(summary["final_checksums"]) == ["0", "1", "2", "3"]
    assert losses == reference[0]
    assert digests == {reference[1]}


def test_a_coordinator_killed_mid_commit_is_rebuilt_into_the_same_bits(tmp_path, reference):
    # The coordinator SIGKILLs itself right after sending step 2's commit to replica 0 only: the
    # restarted one rebuilds from the workers' reports and writes step 2's line from their votes.
    out = tmp_path / "rebuilt"
    plan = _plan(tmp_path, [{"kind": "coordinator_crash", "replica": 0, "step": 2, "phase": "commit_sent"}])
    losses, digests = _run(out, "recover", 3, "--faults", plan)
    assert_every_planned_fault_fired(out)
    _, metrics, _ = load_run(out)
    assert metrics[2].get("rebuilt") is True
    assert losses == reference[0]
    assert digests == {reference[1]}
