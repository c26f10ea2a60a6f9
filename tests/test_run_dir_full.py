"""A run directory that stops taking lines does not end the run (core/coordinator/service.py).

Real processes, no root: a few steps in, the coordinator's file size limit
(RLIMIT_FSIZE, set on its PID from outside with prlimit, as a user may on a process
of their own) is lowered to what metrics.jsonl already holds, so every later write
to it fails in the kernel (EFBIG: the same OSError path as a full disk's ENOSPC,
with a short write when a line crosses the limit); a moment later the limit is lifted.
What is shown: the run goes on through it and ends ok (exit 0), metrics.jsonl holds
every step once, in order, whole; the coordinator's log says once that writing
failed and once that it is written again; no log holds a traceback.
And `recover train` itself (the launcher), limited the same way once its run is
under way: it cannot write summary.json, and ends with one line on stderr naming the
file, the error and what the run did, and exit 7 (EXIT_RUN_DIR_UNWRITABLE).
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_run

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]

STEPS = 60
PACE = 0.05  # seconds per microbatch at least: 2 per replica per step, so >= 0.1 s per step


def _wait_for(what, deadline: float, proc: subprocess.Popen):
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        assert proc.poll() is None, "the run ended before the test could act on it"
        time.sleep(0.05)
    raise AssertionError("timed out")


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _train(out: Path, steps: int) -> subprocess.Popen:
    # Every microbatch lasts at least PACE (a `pace` fault from step 0, both replicas): on a
    # fast, quiet machine the tiny model's 60 steps took less than the test's 1.5 s of held
    # writes, and the run ended while its files were still limited.
    out.parent.mkdir(parents=True, exist_ok=True)
    plan = out.parent / f"{out.name}_plan.json"
    plan.write_text(json.dumps({"faults": [
        {"kind": "pace", "replica": r, "step": 0, "phase": "forward", "seconds": PACE} for r in (0, 1)]}))
    return subprocess.Popen(
        [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "recover", "--model", "tiny",
         "--replicas", "2", "--microbatches", "4", "--steps", str(steps), "--seed", "5", "--no-progress",
         "--faults", str(plan), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: its coordinator and workers
        proc.wait()


def test_metrics_writes_that_fail_for_a_while_are_held_and_written_the_run_goes_on(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, STEPS)
    try:
        deadline = time.monotonic() + 150
        metrics, log = out / "metrics.jsonl", out / "logs" / "coordinator.log"
        _wait_for(lambda: _lines(metrics) >= 3, deadline, proc)
        coordinator = json.loads((out / "pids.json").read_text())["coordinator"]
        _, hard = resource.prlimit(coordinator, resource.RLIMIT_FSIZE)
        resource.prlimit(coordinator, resource.RLIMIT_FSIZE, (metrics.stat().st_size, hard))
        _wait_for(lambda: log.exists() and "cannot write" in log.read_text(), deadline, proc)
        held_from = _lines(metrics)
        time.sleep(1.5)  # steps commit meanwhile, their lines held
        assert _lines(metrics) == held_from  # nothing reached the file while it was limited
        resource.prlimit(coordinator, resource.RLIMIT_FSIZE, (hard, hard))
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _end(proc)
    assert proc.returncode == 0, stdout + stderr
    _, lines, summary = load_run(out)
    assert summary["status"] == "ok"
    assert [m["step"] for m in lines] == list(range(STEPS))
    assert metrics.read_bytes().count(b"\n") == STEPS  # no torn line: the short write was continued
    text = log.read_text()
    assert text.count("cannot write") == 1 and "File too large" in text and "the run goes on" in text
    assert text.count("is written again") == 1
    for f in [*(out / "logs").iterdir()]:
        assert "Traceback" not in f.read_text(), f
    assert "Traceback" not in stderr


def test_recover_train_that_cannot_write_summary_json_says_so_in_one_line_and_exits_7(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, 12)
    try:
        deadline = time.monotonic() + 150
        _wait_for(lambda: _lines(out / "metrics.jsonl") >= 2, deadline, proc)
        # the launcher only: its coordinator and workers, started already, keep their own limit
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (64, hard))
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _end(proc)
    assert proc.returncode == 7, stdout + stderr
    assert "Traceback" not in stderr and not (out / "summary.json").exists()
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"recover train: cannot write {out / 'summary.json'}: [Errno 27] File too large")
    assert "the run: ok, 12/12 steps committed" in line
