"""A replica of many ranks healed: `recover train --shard 2`, `--tp 2` or `--pp 2`, `--replace-after`, real processes.

A rank of replica 1 is SIGKILLed; the launcher starts a new process set in its slot, the
coordinator admits it at the next commit, and each rank of the donor replica sends its
shard (weights and AdamW state) to the newcomer's rank at the same position, every
position at once. `--min-replicas 3` makes the next step wait at the boundary for it, so
the run ends at full strength whatever this loaded machine's start-up time. Evidence from
what the workers reported: the ledgers of every committed step (metrics.jsonl), the
newcomer's per-rank shard fingerprints (its "healed", in the join record) against those
the donor's ranks logged, the members' vote fingerprints, and the final checksums.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_every_planned_fault_fired, load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs

R, S, M, STEPS = 3, 2, 6, 5  # S: ranks per replica, at either layout
COMMON = ["--replicas", str(R), "--microbatches", str(M), "--steps", str(STEPS), "--heartbeat-timeout", "2",
          "--no-progress"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    """The failure-free run at each layout (plain: the same shards, no coordinator), made on first use."""
    made: dict[str, list[dict]] = {}

    def of(layout: str) -> list[dict]:
        if layout not in made:
            out = tmp_path_factory.mktemp("ref") / "plain"
            run_recover("train", "--system", "plain", *COMMON, f"--{layout}", str(S), "--out", str(out),
                        check=True, timeout=200)
            made[layout] = load_run(out)[1]
        return made[layout]

    return of


def _shard_fingerprints_logged(log: str) -> list[str]:
    """The shard fingerprints by rank a leader logged after a state transfer (core/worker/replica.py)."""
    [line] = [ln for ln in log.splitlines() if "every position at once" in ln]
    return json.loads(re.search(r"shard fingerprints by rank (\[[^\]]*\])", line).group(1))


@pytest.mark.timeout(400)
# a follower of FSDP2's, the leader of TP's, the last stage of a pipeline's
@pytest.mark.parametrize("layout, rank", [("shard", 1), ("tp", 0), ("pp", 1)])
def test_a_rank_killed_and_its_replica_replaced_and_healed_rank_to_rank(tmp_path, references, layout, rank):
    reference = references(layout)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 1, "rank": rank, "step": 1, "phase": "backward", "microbatch": 0}]}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *COMMON, f"--{layout}", str(S), "--replace-after", "0.2",
                       "--min-replicas", str(R),
                       "--faults", str(plan), "--out", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    [fired] = assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    # every committed step's ids, from the members' ledgers, are the failure-free run's
    assert [m["step"] for m in metrics] == [m["step"] for m in reference] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == iteration_ids(m["step"], M)  # the members' ledgers, each id once
        assert m["microbatch_id_ranges"] == ref["microbatch_id_ranges"]  # the failure-free run's ids
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5), m["step"]
    [join] = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "join"]
    assert (join["replica"], join["why"]) == (1, "replacement")
    assert join["first_commit_step"] >= 2  # never inside step 1, where it died
    members = {m["step"]: m for m in metrics}
    assert 1 not in members[join["first_commit_step"] - 1]["members"]
    assert all(members[s]["members"] == [0, 1, 2] for s in range(join["first_commit_step"], STEPS))  # full strength
    # each newcomer rank's shard is its donor position's: the fingerprints the newcomer's ranks
    # checked and reported, against those the donor's ranks logged (and they differ by position)
    donor = join["donor"]
    sent = _shard_fingerprints_logged((out / "logs" / f"replica{donor}.log").read_text())
    got = [join["shard_fingerprints"][str(i)] for i in range(S)]
    assert got == sent and len(set(got)) == S
    assert _shard_fingerprints_logged((out / "logs" / "replica1.log").read_text()) == sent
    for i in range(1, S):  # each follower of the newcomer received its own position's
        log = (out / "logs" / f"replica1_rank{i}.log").read_text()
        assert f"state transfer of position {i} received from replica {donor}" in log
        assert f"shard fingerprint {sent[i]}" in log
    assert join["bytes"] > 3 * 4 * 100_000  # every position's weights and both AdamW moments
    # the replica's fingerprint at its first vote (every rank's shard) is every member's
    assert set(join["member_digests"]) == {"0", "1", "2"}
    assert set(join["member_digests"].values()) == {join["weights_digest"]}
    finals = summary["final_checksums"]
    assert sorted(finals) == ["0", "1", "2"] and len(set(finals.values())) == 1, finals
    # a new process set in the slot: the killed one first
    ones = [p for p in summary["processes"] if p["role"] == "worker" and p["replica"] == 1]
    assert [p["how"] for p in ones] == ["killed by SIGKILL", "exited 0"], ones
    assert join["pid"] == ones[1]["pid"] != ones[0]["pid"]
    pids = json.loads((out / "pids.json").read_text())["replicas"]["1"]
    assert fired["pid"] not in pids and join["pid"] == pids[0]  # pids.json names the replacement's ranks


@pytest.mark.timeout(300)
def test_a_frozen_leader_declared_dead_rejoins_with_its_ranks_when_it_wakes(tmp_path, references):
    # The leader of replica 1 SIGSTOPs itself in step 1 and is SIGCONTed 3 s later (past the 1.5 s
    # heartbeat deadline); its follower waits for it in FSDP2's collectives meanwhile. Woken, the
    # leader reads "fenced", relays "rejoin" (both ranks drop what they folded and leave the step),
    # and the same two processes are admitted again and healed rank to rank: no replacement.
    reference = references("shard")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        {"kind": "hang", "replica": 1, "rank": 0, "step": 1, "phase": "backward", "microbatch": 0, "seconds": 3}]}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *COMMON, "--shard", str(S), "--heartbeat-timeout", "1.5",
                       "--min-replicas", str(R), "--faults", str(plan), "--out", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    [fired] = assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == iteration_ids(m["step"], M)
        assert m["microbatch_id_ranges"] == ref["microbatch_id_ranges"]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5), m["step"]
    events = read_jsonl(out / "events.jsonl")
    recoveries = [e for e in events if e["kind"] == "recovery"]
    assert recoveries[0]["step"] == 1 and "no heartbeat" in recoveries[0]["fault"], recoveries
    [join] = [e for e in events if e["kind"] == "join"]
    assert (join["replica"], join["why"], join["pid"]) == (1, "woken", fired["pid"])
    members = {m["step"]: m for m in metrics}
    assert all(members[s]["members"] == [0, 1, 2] for s in range(join["first_commit_step"], STEPS))
    sent = _shard_fingerprints_logged((out / "logs" / f"replica{join['donor']}.log").read_text())
    assert [join["shard_fingerprints"][str(i)] for i in range(S)] == sent
    assert set(join["member_digests"].values()) == {join["weights_digest"]}
    # the same processes, both ranks, to the end
    ones = [p for p in summary["processes"] if p["role"] == "worker" and p["replica"] == 1]
    assert [(p["pid"], p["how"]) for p in ones] == [(fired["pid"], "exited 0")], ones
    assert "rejoining as a newcomer" in (out / "logs" / "replica1.log").read_text()
    assert "received from replica" in (out / "logs" / "replica1_rank1.log").read_text()
    finals = summary["final_checksums"]
    assert sorted(finals) == ["0", "1", "2"] and len(set(finals.values())) == 1, finals


@pytest.mark.timeout(300)
def test_every_rank_of_a_replica_frozen_by_pid_rejoins_when_woken(tmp_path, references):
    # Every process of replica 1 SIGSTOPped by its PID after two commits, SIGCONTed 3.5 s later
    # (past the 1.5 s heartbeat deadline): the replica is declared dead, and once woken its
    # leader's watch must not take its ranks' unread beats for silence. `--min-replicas 3` holds
    # the step after the loss at the boundary until it is back, so the run cannot end without it.
    reference = references("shard")
    out = tmp_path / "run"
    args = ["train", "--system", "recover", *COMMON, "--shard", str(S), "--heartbeat-timeout", "1.5",
            "--min-replicas", str(R), "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "recover.experiments.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(read_metrics(out / "metrics.jsonl")) < 2 or not (out / "pids.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        frozen = json.loads((out / "pids.json").read_text())["replicas"]["1"]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(3.5)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout + stderr
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == iteration_ids(m["step"], M)
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5), m["step"]
    events = read_jsonl(out / "events.jsonl")
    assert any(e["kind"] == "recovery" and "replica 1 lost: no heartbeat" in e["fault"] for e in events), events
    [join] = [e for e in events if e["kind"] == "join"]
    assert (join["replica"], join["why"], join["pid"]) == (1, "woken", frozen[0])
    members = {m["step"]: m for m in metrics}
    assert all(members[s]["members"] == [0, 1, 2] for s in range(join["first_commit_step"], STEPS))
    assert set(join["member_digests"].values()) == {join["weights_digest"]}
    ones = [p for p in summary["processes"] if p["role"] == "worker" and p["replica"] == 1]
    assert [(p["pid"], p["how"]) for p in ones] == [(frozen[0], "exited 0")], ones
    finals = summary["final_checksums"]
    assert sorted(finals) == ["0", "1", "2"] and len(set(finals.values())) == 1, finals
