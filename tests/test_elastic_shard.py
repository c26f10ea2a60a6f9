"""Elastic at replicas of many ranks: `recover train --system elastic --shard 2`, real torchrun agents.

What is shown: 2 nodes (torchrun agents, c10d rendezvous), each a replica of 2 workers
(`--nproc-per-node 2`: recover's rank grid inside the node, FSDP2 over its ranks, sharded
DCP checkpoints). Rank 1 of node 1 (a worker, not its agent) is SIGKILLed by its PID
mid-run: TorchElastic restarts every worker of both nodes, and the job resumes from the
last complete sharded checkpoint. Every step is committed once with its failure-free ids,
and the losses are plain data parallelism's at the same layout, bit for bit (same group,
same ids, same order). Evidence from the workers' own metrics.jsonl and events.jsonl.
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

from conftest import load_run, pid_alive, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics, step_ids

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

STEPS, M, EVERY = 6, 4, 2
LAYOUT = ["--shard", "2", "--replicas", "2", "--microbatches", str(M), "--steps", str(STEPS), "--no-progress",
          "--seed", "3"]


def _workers(agent: int) -> dict[int, int]:
    """torchrun's LOCAL_RANK -> PID of the agent's live workers (its children)."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"LOCAL_RANK=")]
            if ranks:
                found[int(ranks[0])] = int(pid)
    return found


def test_a_worker_killed_by_pid_restarts_every_worker_from_the_sharded_checkpoint(tmp_path):
    out = tmp_path / "elastic"
    # --elastic-min-nodes 2: each round waits for both nodes (this test is about a worker, not a node)
    cmd = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "elastic", *LAYOUT,
           "--checkpoint-every", str(EVERY), "--elastic-min-nodes", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 150
        while len(read_metrics(out / "metrics.jsonl")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        agents = json.loads((out / "pids.json").read_text())["replicas"]
        seen = [pid for node in agents.values() for a in node for pid in [a, *_workers(a).values()]]
        victim = _workers(agents["1"][0])[1]
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == list(range(STEPS))  # every step once
    assert all(step_ids(m) == iteration_ids(m["step"], M) for m in metrics)
    assert all(m["members"] == [0, 1] for m in metrics)  # a worker's crash: both nodes again
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["kind"] == "restart" and event["members"] == [0, 1] and event["world"] == 2
    start = event["from_step"]
    assert start >= 2 and start % EVERY == 0
    assert [m["generation"] for m in metrics] == [0] * start + [1] * (STEPS - start)
    # sharded: each of node 0's 2 workers wrote its own file into every checkpoint
    for ckpt in (out / "baseline" / "checkpoints").iterdir():
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert summary["status"] == "ok" and summary["restarts"] == 1
    assert victim in seen and not [p for p in seen if pid_alive(p)]  # the agents and first workers are gone
    # same group, same ids, same order: plain's losses at the same layout, bit for bit
    ref = tmp_path / "plain"
    run_recover("train", "--system", "plain", *LAYOUT, "--out", str(ref), check=True, timeout=120)
    assert [m["loss"] for m in metrics] == [m["loss"] for m in load_run(ref)[1]]
