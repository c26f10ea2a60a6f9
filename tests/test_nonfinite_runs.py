"""A non-finite loss in a real run, and how workers end.

`recover launch` runs tests/nonfinite_loop.py (examples/user_loop.py whose loss is
NaN at the microbatch ids RECOVER_TEST_NAN_IDS names) as 2 replicas. Before this,
the NaN went out as a vote line the coordinator refused as malformed, and the run
died ~2.5 minutes later with "no replica left" and tracebacks in every worker log.
Now: stopped within seconds naming the step, the replica and the id (exit 1), or,
with --on-nonfinite skip, the step is dropped and the run goes on, deterministically,
along the trajectory computed here in-process. Every worker ends with one line and
its exit code: no traceback, no C++ terminate.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import run_recover_killing

from recover.core.storage.results import read_jsonl, read_metrics

pytestmark = pytest.mark.procs

LOOP = str(Path(__file__).resolve().parent / "nonfinite_loop.py")
R, M, STEPS, NAN_STEP = 2, 4, 6, 3
NAN_ID = NAN_STEP * M + 1  # step 3's ids are 12..15; replica 0's equal share is 12, 13
ARGS = ["--replicas", str(R), "--microbatches", str(M), "--steps", str(STEPS), "--heartbeat-timeout", "3"]


def launch(out: Path, *extra: str, nan_ids: str = str(NAN_ID), timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "recover.experiments.cli", "launch", *ARGS, *extra, "--out", str(out),
                           "--", sys.executable, LOOP], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "RECOVER_TEST_NAN_IDS": nan_ids})
    return proc, time.monotonic() - start


def assert_clean_worker_logs(out: Path, code: int) -> list[str]:
    """Each worker's log: no traceback, no C++ terminate, and its last line says its exit code."""
    lasts = []
    for r in range(R):
        text = (out / "logs" / f"replica{r}.log").read_text()
        assert "Traceback" not in text and "terminate called" not in text, text
        last = text.strip().splitlines()[-1]
        assert last.startswith(f"replica {r} exits with code {code}: "), text
        lasts.append(last)
    return lasts


def reference_losses(skip: int | None) -> list[float | None]:
    """tests/nonfinite_loop.py trained in one process over all M ids per step, step `skip` dropped
    as --on-nonfinite skip drops it (no update; the LambdaLR moves on). None for the skipped step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    losses: list[float | None] = []
    for step in range(STEPS):
        if step == skip:
            losses.append(None)
            with warnings.catch_warnings():  # no optimizer step, on purpose: the schedule alone moves on
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
            continue
        opt.zero_grad()
        total = 0.0
        for mb in range(step * M, (step + 1) * M):
            g = torch.Generator().manual_seed(mb)
            x = torch.randn(32, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(x.sum(dim=1, keepdim=True)))
            loss.backward()
            total += loss.item()
        for p in model.parameters():
            p.grad /= M
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total / M)
    return losses


def test_a_nan_loss_stops_the_run_within_seconds_naming_it(tmp_path):
    out = tmp_path / "stop"
    proc, took = launch(out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 30, took  # was ~150 s of silence before "no replica left"
    (end,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "run_end"]
    assert end["code"] == 1
    for words in (f"step {NAN_STEP} ", "non-finite loss", f"replica 0: microbatch(es) [{NAN_ID}]",
                  f"steps before {NAN_STEP} are committed"):
        assert words in end["reason"], end
    assert end["reason"] in (out / "logs" / "coordinator.log").read_text()
    assert end["reason"] in proc.stdout  # the launcher's last line
    (rec,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "nonfinite"]
    assert (rec["step"], rec["nonfinite"], rec["action"]) == (NAN_STEP, {"0": [[NAN_ID, NAN_ID + 1]]}, "stop")
    assert not [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "refused"]  # no malformed vote
    metrics = read_metrics(out / "metrics.jsonl")
    ref = reference_losses(None)
    assert [m["step"] for m in metrics] == list(range(NAN_STEP))  # everything before it, nothing after
    assert all(abs(m["loss"] - ref[m["step"]]) <= 1e-5 * ref[m["step"]] for m in metrics)
    lasts = assert_clean_worker_logs(out, 1)
    assert all(f"[{NAN_ID}]" in last for last in lasts)
    assert f"step {NAN_STEP}: non-finite loss at microbatch(es) [{NAN_ID}]" in (out / "logs" / "replica0.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(p["how"] for p in summary["processes"] if p["role"] == "worker") == ["exited with code 1"] * R


def test_with_skip_the_step_is_dropped_recorded_and_the_run_is_deterministic(tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc, _ = launch(out, "--on-nonfinite", "skip")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs.append((out, read_metrics(out / "metrics.jsonl")))
    ref = reference_losses(NAN_STEP)
    for out, metrics in runs:
        assert [m["step"] for m in metrics] == [s for s in range(STEPS) if s != NAN_STEP]
        for m in metrics:
            assert abs(m["loss"] - ref[m["step"]]) <= 1e-5 * ref[m["step"]], (m["step"], m["loss"], ref)
            assert m["lr"] == pytest.approx(0.05 * min(1.0, (m["step"] + 1) / 5))  # the schedule by step index
        events = read_jsonl(out / "events.jsonl")
        (rec,) = [e for e in events if e["kind"] == "nonfinite"]
        assert (rec["step"], rec["microbatch_ids"], rec["action"]) == (NAN_STEP, [NAN_ID], "skip")
        (end,) = [e for e in events if e["kind"] == "run_end"]
        assert end["code"] == 0 and f"[{NAN_STEP}] skipped" in end["reason"]
        for r in range(R):
            text = (out / "logs" / f"replica{r}.log").read_text()
            assert f"step {NAN_STEP} skipped" in text and "Traceback" not in text and "terminate called" not in text
    assert [m["loss"] for m in runs[0][1]] == [m["loss"] for m in runs[1][1]]  # a rerun gives the same losses


def test_when_the_coordinator_is_gone_for_good_workers_exit_4_with_one_line(tmp_path):
    out = tmp_path / "gone"
    proc, _ = run_recover_killing(
        ["launch", *ARGS, "--steps", "100000", "--coordinator-restarts", "0", "--reconnect-timeout", "2",
         "--coordinator-timeout", "2", "--out", str(out), "--", sys.executable, LOOP],
        out, replica=-1, after_commits=2, timeout=90)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lasts = assert_clean_worker_logs(out, 4)
    assert all("the coordinator is gone" in last for last in lasts), lasts
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(p["how"] for p in summary["processes"] if p["role"] == "worker") == ["exited with code 4"] * R


def test_a_stop_for_a_nonfinite_loss_leaves_the_last_committed_state_as_a_checkpoint(tmp_path):
    """The worker's side of a stop that says `committed` (core/training/resilient.py): the lowest member
    writes the state before the stopped step as that step's checkpoint, which the next multiple of
    --checkpoint-every would not have been; another member, or a stale count, writes nothing.
    (In-process, with a tiny workload: the run itself cannot be made to produce a NaN.)"""
    from types import SimpleNamespace

    from recover.core.training.checkpoint import CheckpointDir, TrainingState
    from recover.core.config.train_config import TrainConfig
    from recover.core.launch.hooks import WorkerHooks
    from recover.core.training.resilient import _Checkpointer
    from recover.core.training.workload import Workload

    cfg = TrainConfig(system="recover", out=str(tmp_path), steps=10, checkpoint_every=4, replicas=2, microbatches=2)
    work = Workload(cfg, "cpu")
    saver = _Checkpointer(cfg, TrainingState.of(work), WorkerHooks(), 0)
    ckpts = CheckpointDir(cfg.checkpoint_root())
    saver.save_stopped(SimpleNamespace(step=3, generation=2, replica=1, members=[0, 1]), 3)  # not the lowest
    saver.save_stopped(SimpleNamespace(step=2, generation=2, replica=0, members=[0, 1]), 3)  # not at that step
    saver.save_stopped(SimpleNamespace(step=3, generation=2, replica=0, members=[0, 1]), None)  # not a NaN stop
    assert ckpts.complete_steps() == []
    saver.save_stopped(SimpleNamespace(step=3, generation=2, replica=0, members=[0, 1]), 3)
    assert ckpts.complete_steps() == [3]
    assert [json.loads(line)["step"] for line in (tmp_path / "checkpoints.jsonl").read_text().splitlines()] == [3]
