"""The walking skeleton end to end: real multi-process gloo training via the CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_run, pid_alive, run_recover

from recover.core.config.train_config import TrainConfig
from recover.core.components.data import iteration_ids
from recover.core.storage.results import step_ids

pytestmark = pytest.mark.procs  # every test here starts processes

# Measured: 1 vs 4 replicas differ only by summation order; over 8 steps of the
# tiny model the largest relative loss difference seen was ~1e-6 (fp32).
LOSS_RTOL = 1e-4


def check_contract(out: Path, replicas: int, steps: int) -> None:
    """The results contract every system shares, as a plain run writes it."""
    config, metrics, summary = load_run(out)
    assert config["train"]["replicas"] == replicas and config["model"]["n_layer"] == 2
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert step_ids(m) == iteration_ids(m["step"], 8)
        assert m["members"] == list(range(replicas)) and m["generation"] == 0
        assert m["tokens"] == 8 * 4 * 64
        assert m["wall_time"] > 0
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learns
    assert summary["status"] == "ok" and summary["steps"] == steps
    assert summary["final_loss"] == metrics[-1]["loss"]
    assert len(summary["final_checksums"]) == replicas and "weights_checksum" in summary  # replicas agree
    assert (out / "logs" / f"replica{replicas - 1}.log").exists()


def test_one_and_three_replicas_give_the_same_losses(tmp_path):
    """3 replicas fold uneven shares of M=8 (3, 3, 2): the mean gradient must not care."""
    losses = {}
    for r in (1, 3):
        out = tmp_path / f"r{r}"
        proc = run_recover("train", "--replicas", str(r), "--microbatches", "8", "--steps", "8", "--seed", "7",
                           "--out", str(out), "--no-progress", check=True, python_flags=("-X", "importtime"))
        # The launcher process only starts others: it never pays torch's import (the
        # workers' logs go to DIR/logs, so this stderr is the launcher's alone).
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert "recover.experiments.run" in imported and "torch" not in imported
        check_contract(out, r, 8)
        losses[r] = [m["loss"] for m in load_run(out)[1]]
    assert len(losses[1]) == len(losses[3]) == 8
    for a, b in zip(losses[1], losses[3]):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (losses[1], losses[3])


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "4", "--microbatches", "3"], "--microbatches"),
        (["--model", "gpt5"], "--model"),
        (["--data", "/nonexistent/corpus.txt"], "--data"),
        (["--system", "magic"], "--system"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_flag_fails_at_once_naming_the_flag(tmp_path, flags, flag):
    out = tmp_path / "never"
    proc = run_recover("train", *flags, "--out", str(out), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], proc.stderr
    assert not out.exists()  # nothing started, nothing written


def test_help_documents_every_flag():
    from dataclasses import fields

    text = run_recover("train", "--help", timeout=60).stdout
    for f in fields(TrainConfig):
        if f.metadata.get("cli") is not False:
            assert "--" + f.name.replace("_", "-") in text


def _start_long_run(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "recover.experiments.cli", "train", "--replicas", "3", "--microbatches", "6",
         "--steps", "100000", "--out", str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_for_steps(out: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        m = out / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= n:
            return json.loads((out / "pids.json").read_text())
        time.sleep(0.1)
    raise AssertionError("run made no progress")


def _all_pids(pids: dict) -> list[int]:
    return [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)]


def _assert_all_gone(pids: list[int], timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "orphan processes left behind"


def test_worker_crash_ends_the_plain_job_and_leaves_no_orphan(out_dir):
    proc = _start_long_run(out_dir)
    try:
        pids = _wait_for_steps(out_dir, proc, 2)
        victim = pids["replicas"]["1"][0]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert f"replica 1 (pid {victim}) killed by SIGKILL" in err
        summary = json.loads((out_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and "replica 1" in summary["reason"]
        _assert_all_gone(_all_pids(pids))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_stops_everything(out_dir):
    proc = _start_long_run(out_dir)
    try:
        pids = _wait_for_steps(out_dir, proc, 1)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert json.loads((out_dir / "summary.json").read_text())["reason"].startswith("interrupted")
        _assert_all_gone(_all_pids(pids))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
