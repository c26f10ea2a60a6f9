"""`recover bench coordinator --service` at tiny N: the real membership service against
simulated replicas, with a real crash (a closed connection) and a real freeze (silence).

What is checked is that the figures are measurements taken from the run, not that
they are fast: each comes with the evidence it was measured from (the coordinator's
own commit records, the clients' counts), and a freeze cannot be seen before the
heartbeat timeout has passed, so its detection time is at least that.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_recover
from recover.core.contract.heartbeat import MISSED_BEATS, heartbeat_plan
from recover.core.storage.results import read_jsonl, read_metrics
from recover.experiments.cli import main as recover

HB_TIMEOUT = 1.0


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_service_bench_measures_a_real_run(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    proc = run_recover("bench", "coordinator", "--service", "--replicas", "8", "--clients", "2", "--step-seconds",
                       "0.3", "--steady-steps", "3", "--crashes", "1", "--freezes", "1", "--heartbeat-timeout",
                       str(HB_TIMEOUT), "--heartbeat-budget", "40", "--out", str(out), "--work", str(work), "--no-figure", timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((out / "coordinator_service.json").read_text())["rows"]
    assert (row["replicas"], row["clients"], row["steps"]) == (8, 2, 2 + 3 + 2 * 2 + 1)
    # 8 replicas within 40 heartbeats/s: the coordinator named a 0.2 s interval, and the clients took it
    assert row["heartbeat_interval"] == pytest.approx(8 / 40) and row["heartbeat_timeout"] == HB_TIMEOUT

    # The step latency is the service's own record of each steady commit.
    metrics = read_metrics(work / "n8" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(row["steps"]))
    steady = [m["coordinator"]["vote_to_commit_s"] for m in metrics[2:5]]
    assert sorted(row["samples"]["step_latency_s"]) == sorted(steady) and all(s > 0 for s in steady)
    assert row["client_step_latency_s"] > 0

    # CPU share and heartbeat rate over the steady window, from the commits that bound it.
    a, b = metrics[1], metrics[4]
    window = b["wall_time"] - a["wall_time"]
    assert row["window_s"] == pytest.approx(window)
    assert row["cpu_s"] == pytest.approx(b["coordinator"]["cpu_s"] - a["coordinator"]["cpu_s"]) and row["cpu_s"] > 0
    assert row["heartbeats_per_s"] == pytest.approx((b["coordinator"]["heartbeats"] - a["coordinator"]["heartbeats"])
                                                    / window)
    # steps (0.3 s) longer than the interval (0.2 s): heartbeats between the votes
    assert row["heartbeats_per_s"] > 0 and row["messages_per_s"] > row["heartbeats_per_s"]
    # every heartbeat the coordinator counted was sent by a client
    assert 0 < row["heartbeats_handled"] <= row["heartbeats_sent"]

    # One crash and one freeze, each recovered as what it was.
    recoveries = [e for e in read_jsonl(work / "n8" / "events.jsonl") if e.get("kind") == "recovery"]
    assert [("closed" in e["fault"], "no heartbeat" in e["fault"]) for e in recoveries] == [(True, False),
                                                                                          (False, True)]
    assert len(row["crash_detect_s"]) == 1 and row["crash_detect_s"][0] > 0
    assert row["crash_abort_all_s"][0] >= row["crash_detect_s"][0]  # the abort goes out after the crash is seen
    assert len(row["freeze_detect_s"]) == 1 and row["freeze_detect_s"][0] >= HB_TIMEOUT
    fired = [f for k in range(2) for f in json.loads((work / "n8" / f"client{k}.json").read_text())["faults"]]
    assert sorted(f["kind"] for f in fired) == ["crash", "freeze"]


def test_service_bench_refuses_bad_flags_before_starting(capsys):
    assert recover(["bench", "coordinator", "--service", "--replicas", "2", "--crashes", "1", "--freezes", "1"]) == 2
    assert "--crashes" in capsys.readouterr().err
    assert recover(["bench", "coordinator", "--service", "--heartbeat-timeout", "0.1"]) == 2
    assert "--heartbeat-timeout" in capsys.readouterr().err


@pytest.mark.parametrize("replicas", [1, 8, 200, 201, 4096, 100_000])
def test_heartbeat_plan_keeps_the_rate_within_the_budget(replicas):
    interval, timeout, budget = 0.1, 3.0, 2000.0
    every, dead_after = heartbeat_plan(replicas, interval, timeout, budget)
    assert replicas / every <= budget + 1e-9 and every >= interval
    if replicas <= budget * interval:  # a small run keeps its configured heartbeats
        assert (every, dead_after) == (interval, timeout)
    assert dead_after >= max(timeout, MISSED_BEATS * every)
