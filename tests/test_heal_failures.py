"""A failed state transfer is a failed transfer, whatever raised, and it is bounded.

Real processes: `recover launch` runs tests/heal_fail_loop.py (examples/user_loop.py whose
optimizer cannot be sent the first two times a transfer reads it: its state dict then holds an
int64 tensor, which the transfer's layout code refuses with a TypeError on the donor) as 2
replicas, with `--replace-after 0.2 --min-replicas 2 --max-heal-attempts 2`. Replica 1 is
SIGKILLed after a few commits. Its replacement is admitted at the next commit, the donor's
transfer raises, the donor survives (it reports the failure, the generation fails and is redone
without the newcomer), the newcomer waits, is admitted again, fails again and is refused with a
record; the launcher then starts another process in the slot, whose transfer succeeds. Checked
from what the workers reported: every step committed once with its ids and its learning rate,
replica 0 is one process that exited 0, and replica 1 is back at the end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import user_loop_committed_every_step

from recover.core.storage.results import read_jsonl, read_metrics

pytestmark = pytest.mark.procs

LOOP = str(Path(__file__).resolve().parent / "heal_fail_loop.py")
STEPS, M = 30, 4


def test_a_donor_survives_a_transfer_error_that_is_not_a_collectives_and_the_newcomer_is_refused_then_replaced(
        tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.experiments.cli", "launch", "--replicas", "2", "--microbatches", str(M),
         "--steps", str(STEPS), "--heartbeat-timeout", "2", "--replace-after", "0.2", "--min-replicas", "2",
         "--max-heal-attempts", "2", "--out", str(out), "--", sys.executable, LOOP],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "RECOVER_TEST_UNSENDABLE": "2"})
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(out / "metrics.jsonl")) < 3 or not (out / "pids.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        victim = json.loads((out / "pids.json").read_text())["replicas"]["1"][0]
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = out / "logs"
    assert proc.returncode == 0, stdout + stderr + (logs / "coordinator.log").read_text()
    metrics = user_loop_committed_every_step(out, STEPS, M)
    exits = json.loads((out / "summary.json").read_text())["processes"]
    # the donor survived both failed transfers: one process, to the end
    zeros = [p for p in exits if p["role"] == "worker" and p["replica"] == 0]
    assert [p["how"] for p in zeros] == ["exited 0"], zeros
    assert (logs / "replica0.log").read_text().count("TypeError: optimizer state 'updates'") == 2
    events = read_jsonl(out / "events.jsonl")
    failed = [e for e in events if e["kind"] == "recovery" and "state transfer: TypeError" in e["fault"]]
    assert len(failed) == 2, [e for e in events if e["kind"] == "recovery"]
    # the first replacement failed twice and was refused; the next one was healed from replica 0
    ones = [p for p in exits if p["role"] == "worker" and p["replica"] == 1]
    assert [p["how"] for p in ones] == ["killed by SIGKILL", "exited with code 3", "exited 0"], ones
    assert [e["attempts"] for e in events if e["kind"] == "join_failed"] == [1, 2]
    (refused,) = [e for e in events if e["kind"] == "join_refused"]
    assert (refused["replica"], refused["pid"], refused["attempts"]) == (1, ones[1]["pid"], 2)
    (join,) = [e for e in events if e["kind"] == "join"]
    assert (join["replica"], join["pid"], join["donor"], join["attempts"]) == (1, ones[2]["pid"], 0, 0)
    assert set(join["member_digests"].values()) == {join["weights_digest"]}
    assert metrics[-1]["members"] == [0, 1]
