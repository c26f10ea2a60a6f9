"""Shared helpers: run the real CLI in a subprocess, read a run's results; hypothesis profiles.

Hypothesis: with the environment variable CI set (`.ci/run` sets it), the "ci"
profile is loaded: derandomized, so every CI run draws the same examples and a red
CI run is reproducible anywhere with `CI=1`; each test's own max_examples still
applies. Without CI, the "dev" profile keeps searching at random, so local runs go
on finding new counterexamples (which then become @example regression cases).

Processes: a test that starts one (a worker, the CLI, a tool) carries the `procs`
marker. `make test-fast` deselects those and sets RECOVER_FAST=1, under which any
other test that forks, spawns or Popens fails naming itself, so the fast loop stays
free of process starts and a missing marker cannot hide.
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
from hypothesis import settings

from recover.core.contract import env_names

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev")
settings.load_profile("ci" if os.environ.get("CI") else "dev")

sys.path.insert(0, str(Path(__file__).parent))

# Workers are forked from a server that has torch imported (core/launch/forkserver.py): the
# suite starts hundreds of short runs, and a fresh `import torch` per worker was most
# of their time on two cores. Set here, so the `recover` CLIs the tests start inherit
# it too. A test about a real interpreter start (a kill during the import) sets spawn.
os.environ.setdefault(env_names.WORKER_START, "fork")


def as_read(msg: dict, r: int, members: list | None = None) -> dict:
    """A gen or commit message as replica r's worker reads it: its quota resolved
    (core.contract.policy.quota_of), whether it came as r's own `quota` or as the `split` all
    members share. A commit names no members: `members` is the generation's (ids or
    id ranges)."""
    if "split" not in msg:
        return msg
    from recover.core.contract import idranges
    from recover.core.contract.policy import quota_of
    mem = msg.get("members", members)
    if mem is None:
        raise ValueError("a commit's shared quota needs the generation's members")
    if mem and not isinstance(mem[0], list):
        mem = idranges.from_ids(mem)
    read = {k: v for k, v in msg.items() if k != "split"}
    read["quota"] = quota_of(msg, mem, r)
    return read


def run_recover(*args: str, timeout: float = 240, check: bool = False,
                python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`recover ARGS...` as a user would run it; a hang fails the test at `timeout`.
    `python_flags` go to the launcher's own interpreter only (e.g. -X importtime).

    Under RECOVER_WORKER_START=fork (the suite's default, above) the CLI is forked from
    this process's fork server (core/launch/forkserver.py) rather than started as a fresh
    interpreter: it then has torch imported, and so its own fork server is a fork of it,
    not a second `import torch` per run (about 2 CPU-seconds each, over a hundred runs).
    What the CLI does is the same: its own process, environment, folder and exit code."""
    argv = [sys.executable, *python_flags, "-m", "recover.experiments.cli", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if os.environ.get(env_names.WORKER_START) == "fork" and not python_flags:
        proc = _run_forked(argv, env, timeout)
    else:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"recover {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _run_forked(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)`, the
    process forked from this test process's fork server (which makes this process a child
    subreaper: an orphan of the run is reaped here, and `pid_alive` reads a zombie as dead)."""
    import tempfile

    from recover.core.launch.forkserver import ForkServer

    with tempfile.TemporaryDirectory(prefix="recover-cli-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        out.touch()
        p = ForkServer.shared().start(argv, env, str(err), stdout_path=str(out), cwd=os.getcwd())
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own process group: the CLI and what it started there
            except ProcessLookupError:
                pass
            p.wait()
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace")) from None
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def load_run(out: Path) -> tuple[dict, list[dict], dict]:
    from recover.core.storage.results import read_metrics

    return (
        json.loads((out / "config.json").read_text()),
        read_metrics(out / "metrics.jsonl"),
        json.loads((out / "summary.json").read_text()),
    )


USER_LOOP = str(Path(__file__).resolve().parents[1] / "examples" / "user_loop.py")


def user_loop_committed_every_step(out: Path, steps: int, microbatches: int) -> list[dict]:
    """metrics.jsonl of an examples/user_loop.py run, checked to have committed each step
    once, each with exactly its ids by the members' reports, and with the example's
    LambdaLR as stepped only on commit (a 5-step warm-up to 0.05), whatever failed."""
    from recover.core.components.data import iteration_ids
    from recover.core.storage.results import read_metrics, reported_ids
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(reported_ids(m) == iteration_ids(m["step"], microbatches) for m in metrics)
    assert [m["lr"] for m in metrics] == pytest.approx([0.05 * min(1.0, (s + 1) / 5) for s in range(steps)])
    return metrics


def assert_every_planned_fault_fired(out: Path) -> list[dict]:
    """Each fault of the run's saved plan (DIR/fault_plan.json) fired exactly once, as
    recorded by the process it struck (DIR/faults.jsonl), on the planned replica and,
    for a point trigger, at the planned step and phase. Returns the records, in plan order.
    (The microbatch is not compared: a trigger's k-th microbatch is its replica's k-th
    or, with a shorter quota, its last; the record says which one it was.)"""
    plan = json.loads((out / "fault_plan.json").read_text())["faults"]
    lines = (out / "faults.jsonl").read_text().splitlines() if (out / "faults.jsonl").exists() else []
    fired = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["index"])
    assert [r["index"] for r in fired] == list(range(len(plan))), (plan, fired)
    for r, f in zip(fired, plan):
        assert (r["kind"], r["replica"]) == (f["kind"], f["replica"]), (f, r)
        if "step" in f:
            assert (r["step"], r["phase"]) == (f["step"], f["phase"]), (f, r)
    return fired


def run_recover_killing(args: list[str], out: Path, replica: int, after_commits: int,
                        timeout: float = 180, rank: int = 0,
                        stop_first: tuple[int, ...] = ()) -> tuple[subprocess.CompletedProcess, int]:
    """`recover ARGS...` in the background; once `after_commits` steps are in
    out/metrics.jsonl, SIGKILL replica `replica`'s worker (its rank `rank`, for a
    replica of many) by its PID (pids.json; replica -1: the coordinator's); wait
    for the run to end. `stop_first`: ranks of that replica SIGSTOPped by their PIDs
    just before the kill (a frozen leader can neither notice the loss nor exit).
    Returns the finished process and the victim's PID."""
    from recover.core.storage.results import read_metrics

    proc = subprocess.Popen([sys.executable, "-m", "recover.experiments.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (len(read_metrics(out / "metrics.jsonl")) < after_commits
                                               or not (out / "pids.json").exists()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        pids = json.loads((out / "pids.json").read_text())
        victim = pids["coordinator"] if replica < 0 else pids["replicas"][str(replica)][rank]
        for k in stop_first:
            os.kill(pids["replicas"][str(replica)][k], signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), victim


def run_killing_rank_1_of_replica_1(args: list[str], out: Path, steps: int, microbatches: int) -> list[dict]:
    """The example tests of a replica of many ranks (HSDP, TP, PP): `recover ARGS...` with rank 1 of
    replica 1 (not its leader) SIGKILLed by its PID after 4 commits, of 3 replicas. Asserts what each
    of them claims beside its losses: the run ends well, the victim was that rank, every step is
    committed with exactly its M ids in the leaders' ledgers, the killed rank's whole replica went
    in one recovery. Returns the run's metrics for the loss comparison."""
    from recover.core.components.data import iteration_ids
    from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

    proc, victim = run_recover_killing(args, out, replica=1, after_commits=4, rank=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert victim == json.loads((out / "pids.json").read_text())["replicas"]["1"][1]  # rank 1, not the leader
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(reported_ids(m) == iteration_ids(m["step"], microbatches) for m in metrics)  # the leaders' ledgers
    assert metrics[-1]["members"] == [0, 2]  # the killed rank's whole replica went
    recoveries = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["survivors"] == [0, 2]
    return metrics


def write_aggregation_run(root: Path, name: str, system: str, train_extra: dict | None = None,
                          faults: tuple[float, ...] = ()) -> None:
    """A 4-step, 2-replica run under root/exp/name as aggregation reads it (the layout tests): plain is
    the failure-free reference "ff", any other system names it; replica 1 leaves after step 1, and each
    wall time in `faults` is a replica_loss recorded in faults.jsonl. `train_extra` adds config.json
    train fields (a layout: shard, tp, pp; runs written before the layout have none)."""
    d = root / "exp" / name
    d.mkdir(parents=True)
    train = {"system": system, "seed": 0, "replicas": 2, "steps": 4, **(train_extra or {})}
    (d / "config.json").write_text(json.dumps({"train": train}))
    (d / "spec.json").write_text(json.dumps({"label": "failure-free" if system == "plain" else system,
                                             "reference": "" if system == "plain" else "ff"}))
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"step": i, "loss": 5.0 - i, "tokens": 10, "microbatch_ids": [2 * i, 2 * i + 1],
                                "generation": 0, "members": [0, 1] if i < 2 else [0], "wall_time": i + 1.0}) + "\n")
    with open(d / "faults.jsonl", "w") as f:
        for t in faults:
            f.write(json.dumps({"kind": "replica_loss", "replica": 1, "step": 1, "wall_time": t}) + "\n")
    (d / "summary.json").write_text(json.dumps({"status": "ok", "steps": 4}))


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """The files with the most real-process tests first, each file's tests kept together.

    The suite runs on pytest-xdist with --dist loadfile: a file is a unit of work,
    handed to the workers in collection order (`make test` passes
    --no-loadscope-reorder: xdist's own order, by number of tests, puts a file of a
    hundred pure tests that take a second before a file of five tests that take
    minutes). A test that starts processes costs seconds to a minute, a pure one
    milliseconds, so a file's count of `procs` tests stands for its time: the
    longest files start first and run beside each other, instead of one of them
    starting last and setting the suite's wall time alone. The order among files of
    equal count is the one collection gave (pytest-randomly's shuffle, the same on
    every worker), so this adds no order of its own to what the tests may rely on."""
    procs: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        f = item.nodeid.split("::", 1)[0]
        first.setdefault(f, i)
        procs[f] = procs.get(f, 0) + (item.get_closest_marker("procs") is not None)
    items.sort(key=lambda item: (-procs[f := item.nodeid.split("::", 1)[0]], first[f]))


@pytest.fixture(autouse=True)
def _no_process_starts_in_the_fast_loop(request, monkeypatch):
    """Under RECOVER_FAST=1, a test without the `procs` marker may not start a process."""
    if not os.environ.get("RECOVER_FAST") or request.node.get_closest_marker("procs"):
        return

    def refuse(*_a, **_k):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.procs")

    # Popen's one way to the OS (subprocess.run/check_output go through it), and the
    # raw calls multiprocessing and os-level spawning use.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def run_ranks_around_a_store(rank_argvs, timeout: float = 240) -> None:
    """One process per argv, around a fresh TCPStore on port 0: `rank_argvs(port)` gives the
    argvs. Waits for all; a rank that fails fails the test with its log; any process still
    running at the end (a hang, a failure of this test) is SIGKILLed by its PID."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for argv in rank_argvs(store.port):
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=env))
        codes = [p.wait(timeout=timeout) for p in procs]
        logs = [p.stdout.read() for p in procs]
        assert codes == [0] * len(procs), "\n".join(f"rank {k}: rc {c}\n{log[-3000:]}" for k, (c, log) in
                                                   enumerate(zip(codes, logs)) if c)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout:
                p.stdout.close()
        del store


def train_metrics(out: Path, *args: str, steps: int, microbatches: int, timeout: float = 300) -> list[dict]:
    """`recover train ARGS` for `steps` steps of `microbatches`, checked to exit 0; its metrics lines."""
    from recover.core.storage.results import read_metrics

    proc = run_recover("train", *args, "--microbatches", str(microbatches), "--steps", str(steps), "--out", str(out),
                       "--no-progress", timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


def assert_plain_is_the_reference(out: Path, metrics: list[dict], reference: tuple[Path, list[dict]],
                                  steps: int, microbatches: int, ranks_per_replica: int) -> None:
    """plain's run at OUT (`metrics`) against recover's failure-free run at the same layout
    (`reference`: its folder and metrics): the same steps, ids and losses (1e-5), the same
    process count per replica, and every replica's final weights checksum equal to recover's."""
    from recover.core.components.data import iteration_ids
    from recover.core.storage.results import reported_ids, step_ids

    ref_out, ref_metrics = reference
    assert [m["step"] for m in metrics] == list(range(steps))
    for m, ref in zip(metrics, ref_metrics):
        assert step_ids(m) == reported_ids(ref) == iteration_ids(m["step"], microbatches)  # (plain reports no ledgers)
        assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    pids = json.loads((out / "pids.json").read_text())["replicas"]
    assert all(len(p) == ranks_per_replica for p in pids.values())
    checksum = json.loads((ref_out / "final" / "replica0.json").read_text())["weights_checksum"]
    for r in pids:
        final = json.loads((out / "final" / f"replica{r}.json").read_text())
        assert final["weights_checksum"] == pytest.approx(checksum, rel=1e-6)


def one_process_losses(model, steps: int, microbatches: int) -> list[float]:
    """The example loops' recipe (examples/tp_loop.py, pp_loop.py: their data, AdamW, a 5-step warm-up,
    clipping at 1.0) for `model` in one process: each step's gradient is the mean over its ids, its
    loss their mean loss. Seed the model's construction before calling (torch.manual_seed(0))."""
    import torch

    from recover.core.components.data import iteration_ids

    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for mb in iteration_ids(step, microbatches):
            g = torch.Generator().manual_seed(mb)
            x = torch.randn(32, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(x.sum(dim=1, keepdim=True))) / microbatches
            loss.backward()
            total += loss.item()
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return losses


def gloo_pair(timeout: float = 30.0):
    """Two gloo `Communicator`s of one generation, built on two threads of this process around a
    TCPStore on a free port: (the store, {rank: communicator}). The store must outlive them."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from recover.core.worker.comm import Communicator
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    comms: dict = {}

    def build(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
        comms[rank] = Communicator.build(lambda: client, 0, rank, 2, "gloo", timeout)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(comms) == 2, comms
    return store, comms
