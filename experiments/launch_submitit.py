"""Launching an experiment grid with submitit: here (local, debug) or on a Slurm cluster.

Contract:
- `submit_grid(grid, ...)` skips every run whose results are already complete
  (`is_complete`: summary.json says status ok and steps == the run's steps), and
  submits the others as job arrays (`executor.map_array`).
- local / debug: one submitit job per run; the job calls `run_one`, which runs
  `experiments.run.run_training` (the project's Launcher starts the coordinator and
  the workers as processes). Local jobs run `parallel` at a time (default 1: on a
  small machine concurrent runs would distort each other's wall times); debug runs
  them in this process. Each run's process logs, pids.json and a baseline's
  internals (checkpoints) are moved out of the results, to LOGS/<experiment>/<run>/,
  so results/ stays small enough to commit; summary.json gets "logs" naming it.
- slurm: each run is ONE multi-task job, one task per rank (`slurm_task`). The
  array is split by job shape (nodes, tasks per node), as a Slurm array shares one
  set of #SBATCH lines. Jobs are submitted with `--no-kill` (sbatch and srun both:
  srun's own default ends the whole step when one node fails), so a node that fails
  takes only its own tasks and the job runs on (`SlurmOptions.no_kill`). Task 0
  writes config.json and starts the coordinator (`python -m recover.core.coordinator.process
  --host 0.0.0.0` on ports the OS picks, or torchft's lighthouse for torchft) and
  publishes its address in the job's sync directory: the job's first node name when
  it resolves (else task 0's own hostname) and the ports the coordinator's first line
  names (a task 0 whose coordinator does not come up says so there, and the other
  tasks stop waiting). Every task then runs the system's worker module for its rank
  with RECOVER_STORE_ADDR / RECOVER_CONTROL_ADDR,
  RECOVER_REPLICA, RECOVER_T0 and the run's RECOVER_JOIN_TOKEN (task 0 draws it,
  hands it to the coordinator and, through the job's sync directory, to every
  task); task 0 waits for the run to end and writes
  summary.json. A system whose `System.on_slurm` is "requeue" (checkpoint-restart)
  is submitted --requeue: on a failure (a rank's worker exits non-zero, fail-fast)
  task 0 leaves the next start its fault notice (DIR/baseline/fault-<n>.json, as the
  local supervisor does) and runs `scontrol requeue` on its job; every start
  (SLURM_RESTART_COUNT) trains at full size from the last complete checkpoint, with
  the run's files and clock kept, until `max_restarts`. elastic (on_slurm "agents")
  runs one `torchrun` agent per task (a node; `_run_agent`), with the c10d rendezvous
  on task 0's store, which no agent hosts. Systems that re-form their
  job with a supervisor of their own and have no Slurm form (on_slurm "") are skipped
  on Slurm with a note. A replica of K ranks (shard x tp x pp) is K consecutive
  tasks (`SlurmTask`: task g is local rank g % K of replica g // K), and `slurm_shape`
  puts whole replicas on each node, so a node that fails takes whole replicas; within a
  replica, the ranks' beats to their leader end the replica when one rank is gone.
- recover with `replace_after` >= 0: task 0 replaces a lost replica (a rank's non-zero
  exit, or its node gone from the job) with a one-node job of its own, which joins the
  run as a newcomer and is healed; none is left queued when the run ends
  (experiments/slurm_replacements.py). summary.json lists them (`replacements`).
- A failed run is reported with the path of its logs (the run's moved logs, or the
  submitit job's stderr when the job itself died).
- Waiting on Slurm (`_wait_slurm`) follows task 0 only (it writes the summary; a
  task lost with its node leaves no result, and that is not the run's failure),
  asking sacct for the job's state every `SlurmOptions.poll_s`. It never waits
  silently on a job that cannot run: sbatch refusing it (an unknown partition, a
  shape no node has) is a failed outcome with sbatch's own message and the script;
  a requeued job held by Slurm (BeginTime, 120 s) is started at once
  (`release_requeued`); a job pending for a reason that no time will lift (`NEVER_STARTS`), or pending
  beyond `SlurmOptions.start_timeout_min`, is cancelled and failed naming the reason
  and its log; a job that ended without task 0's result is failed with its state
  and log.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.baselines.runlog import fault_notice_path
from recover.core.storage.results import read_finals, read_metrics, write_summary
from recover.core.launch.startup import JOIN_TOKEN_ENV, new_join_token
from recover.fault_injection.injector import attach_plan
from recover.core.contract import env_names
from recover.core.launch.coordinator_command import MODULE as COORDINATOR, coordinator_args

from .grids import PLAN_INPUT, Grid, RunSpec
from .run import RUN_FILES, resolved_config_dict, run_training
from .slurm_queue import NEVER_STARTS, SLURM_LIVE, job_state as _job_state, pending_reason as _pending_reason
from .systems import SYSTEMS

EXECUTORS = ("local", "debug", "slurm")
MOVED_OUT = ("logs", "baseline", "pids.json")  # what a run leaves in its dir that is not the contract


@dataclass
class SlurmOptions:
    """The Slurm side of `recover experiment --executor slurm`."""

    partition: str = ""  # --partition ('' = the cluster's default)
    account: str = ""  # --account ('' = the user's default)
    time_min: int = 240  # wall-clock limit of each run's job, minutes
    cpus_per_task: int = 8  # CPUs per rank (data loading, the coordinator on task 0)
    mem_gb: float = 0.0  # memory per node, GB (0 = the cluster's default)
    array_parallelism: int = 4  # runs of one array running at the same time
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load, venv)
    gpus_per_node: int | None = None  # override the scale's GPUs per node
    tasks_per_node: int | None = None  # ranks per node (None: the GPUs per node; all on one node when CPU-only)
    no_kill: bool = True  # sbatch/srun --no-kill: a failed node ends its own tasks, not the job
    poll_s: float = 5.0  # how often a waiting submit asks sacct for a job's state
    start_timeout_min: float = 0.0  # fail a job still pending after this long (0: wait for the queue)
    release_requeued: bool = True  # start a requeued job at once instead of after Slurm's 120 s hold


@dataclass
class Outcome:
    """How one run of a grid ended (or why it did not run)."""

    name: str  # the run's name
    status: str  # ok, failed, skipped (already complete), submitted (slurm, not waited for)
    detail: str = ""  # reason, job id, or log path


def is_complete(run_dir: str | Path, steps: int) -> bool:
    """True when the run's summary says status ok with every one of its `steps` committed."""
    p = Path(run_dir) / "summary.json"
    try:
        s = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return s.get("status") == "ok" and s.get("steps") == steps


# ---- one run, here ------------------------------------------------------------------------
def run_one(spec_dict: dict[str, Any], root: str, logs_root: str) -> dict[str, Any]:
    """The body of a local/debug job: train one RunSpec into root/<experiment>/<name>/."""
    spec = RunSpec.from_dict(spec_dict)
    out = spec.out_dir(root)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # an interrupted rerun must not look complete
    (out / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    spec.write_plan(root)
    cfg = spec.train_config(root)
    plan = attach_plan(cfg)
    try:
        summary = run_training(cfg, plan=plan, settings=spec.settings_obj())
    finally:
        (out / PLAN_INPUT).unlink(missing_ok=True)
        logs = Path(logs_root) / spec.experiment / spec.name
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True, exist_ok=True)
        for name in MOVED_OUT:
            if (out / name).exists():
                shutil.move(str(out / name), str(logs / name))
    summary["logs"] = str(logs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return {"name": spec.name, "status": summary["status"], "steps": summary["steps"],
            "reason": summary.get("reason", ""), "logs": str(logs)}


# ---- one run, as one multi-task Slurm job ------------------------------------------------
def coordinator_host(node: str) -> str:
    """The address the other tasks reach task 0 at: its Slurm node name when that resolves (a real
    cluster), else this host's own name (several slurmd nodes on one machine, as in the tests)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        return socket.gethostname()


def _wait_for(path: Path, timeout: float, failed: Path | None = None) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        if failed is not None and failed.exists():
            raise RuntimeError(f"task 0 failed: {failed.read_text()}")
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:  # being written
                pass
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear within {timeout:.0f}s (task 0 failed? see its log)")


@dataclass
class SlurmTask:
    """Who one task of a run's Slurm job is: its rank in the job, and the replica rank it runs.

    The job's tasks are the run's ranks, replica by replica: task g runs local rank
    g % K of replica g // K (K ranks per replica), so a replica's ranks are
    consecutive tasks, and `slurm_shape` puts them on one node."""

    rank: int  # the task's rank in the job (SLURM_PROCID)
    job_id: str  # this array element's job id
    host0: str  # the job's first node, where task 0 runs
    restart: int  # 0, then +1 per requeue of this job (SLURM_RESTART_COUNT)
    spec: RunSpec  # the run
    out: Path  # the run's directory
    ranks_per_replica: int  # K: the replica's P x S x T ranks

    @classmethod
    def from_env(cls, spec_dict: dict[str, Any], root: str) -> "SlurmTask":
        import submitit

        env = submitit.JobEnvironment()
        spec = RunSpec.from_dict(spec_dict)
        return cls(rank=env.global_rank, job_id=str(env.job_id), host0=env.hostnames[0],
                   restart=int(os.environ.get("SLURM_RESTART_COUNT") or 0), spec=spec, out=spec.out_dir(root),
                   ranks_per_replica=spec.layout().ranks)

    @property
    def replica(self) -> int:
        return self.rank // self.ranks_per_replica

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_replica

    @property
    def ranks(self) -> int:
        """The run's ranks: replicas x ranks per replica (tasks past them are a node's spare slots)."""
        return self.spec.replicas * self.ranks_per_replica

    @property
    def sync(self) -> Path:
        """The job start's own directory of markers: a requeued job never reads an earlier start's."""
        return self.out / ".slurm" / self.job_id / str(self.restart)


def slurm_task(spec_dict: dict[str, Any], root: str, replace: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of every task of a run's Slurm job: one rank of the run (see the module docstring).

    Three roles, in order: task 0 hosts the run's coordinator (`_host_coordinator`); every
    task of a member replica runs its rank (`_run_rank`); task 0 then waits for the run's
    end, replacing lost replicas meanwhile when the run has `replace_after` (`replace`: how
    to submit their jobs, experiments/slurm_replacements.py), and writes its summary (`_finish_run`)."""
    task = SlurmTask.from_env(spec_dict, root)
    if task.rank >= task.ranks:  # the last node's spare task slots
        return {"rank": task.rank, "idle": True}
    system = SYSTEMS[task.spec.system]
    coordinator = _host_coordinator(task, system, root) if task.rank == 0 else None
    task.sync.mkdir(parents=True, exist_ok=True)
    # which node this task runs on: task 0 sees a replica's node leave the job by it
    (task.sync / f"node-{task.rank}").write_text(os.environ.get("SLURMD_NODENAME", ""))
    ready = _wait_for(task.sync / "ready.json", timeout=600, failed=task.sync / "failed.txt")
    members = _members(task.spec, system, task.out, task.restart)
    # task 0 runs replica 0's first rank too: the replacer watches beside it, from the run's start
    replacements = _replacements(task, system, ready, root, replace) if task.rank == 0 else None
    if replacements is not None:
        replacements.start()
    if task.replica not in members:  # a replica lost earlier in a survivors-mode run: its slot stays empty
        (task.sync / f"done-{task.rank}").write_text("0")
        if task.rank != 0:
            return {"rank": task.rank, "idle": True}
        code = 0
    else:
        code = _run_rank(task, system, root, ready, members)
        (task.sync / f"done-{task.rank}").write_text(str(code))
    if task.rank != 0:
        return {"rank": task.rank, "returncode": code}
    return _finish_run(task, system, coordinator, ready, members, code, replacements)


def replacement_task(spec_dict: dict[str, Any], root: str, replica: int, incarnation: int,
                     sync: str) -> dict[str, Any]:
    """The body of every task of a replacement job (experiments/slurm_replacements.py): local rank
    SLURM_PROCID of `replica`, its `incarnation`-th process set, joining the run whose coordinator
    the run's job's sync directory names; its exit goes to SYNC/replacement-<replica>-<incarnation>/."""
    import submitit

    env = submitit.JobEnvironment()
    spec = RunSpec.from_dict(spec_dict)
    k = spec.layout().ranks
    if env.global_rank >= k:
        return {"rank": env.global_rank, "idle": True}
    task = SlurmTask(rank=replica * k + env.global_rank, job_id=str(env.job_id), host0=env.hostnames[0], restart=0,
                     spec=spec, out=spec.out_dir(root), ranks_per_replica=k)
    ready = json.loads((Path(sync) / "ready.json").read_text())
    marks = Path(sync) / f"replacement-{replica}-{incarnation}"
    marks.mkdir(parents=True, exist_ok=True)
    # the replacer's evidence that this job runs: sacct, read through slurmdbd, can still say
    # PENDING of a job whose tasks are running
    (marks / f"started-{env.global_rank}").write_text(str(os.getpid()))
    code = _run_rank(task, SYSTEMS[spec.system], root, ready, list(range(spec.replicas)), incarnation=incarnation)
    (marks / f"done-{env.global_rank}").write_text(str(code))
    return {"replica": replica, "incarnation": incarnation, "rank": env.global_rank, "returncode": code}


def _host_coordinator(task: SlurmTask, system: Any, root: str) -> subprocess.Popen:
    """Task 0: the run's files (first start) and its coordinator, whose address and the run's join
    token go to every task through the job start's sync directory (`ready.json`)."""
    out, config_path = task.out, task.out / "config.json"
    if task.restart == 0:
        t0 = time.time()
        _first_start(task.spec, root, out, config_path)
    else:  # a requeued job resumes the same run: its files, its clock
        t0 = json.loads((out / ".slurm" / task.job_id / "0" / "ready.json").read_text())["t0"]
    token = new_join_token()
    task.sync.mkdir(parents=True, exist_ok=True)
    coordinator = subprocess.Popen(
        _coordinator_argv(task.spec, system, config_path),
        stdout=subprocess.PIPE, env={**os.environ, env_names.T0: repr(t0), JOIN_TOKEN_ENV: token},
    )
    first = coordinator.stdout.readline()  # its first line: it is up, on the ports the OS gave it
    try:
        up = json.loads(first)
    except json.JSONDecodeError:
        why = f"the coordinator did not come up (exit {coordinator.wait(30)}, said {first!r}); see task 0's log"
        (task.sync / "failed.txt").write_text(why)  # the other tasks stop waiting and say so
        raise RuntimeError(why) from None
    # The job's own directory hands the token to its tasks (readable by its owner only).
    ready = task.sync / "ready.json"
    ready.touch(mode=0o600)
    ready.write_text(json.dumps({"t0": t0, "host": coordinator_host(task.host0), "join_token": token,
                                 "store_port": up["store_port"], "control_port": up["control_port"]}))
    return coordinator


def _run_rank(task: SlurmTask, system: Any, root: str, ready: dict, members: list[int], incarnation: int = 0) -> int:
    """Every task of a member replica: the system's worker for its rank (or, for elastic, the
    node's torchrun agent), until it exits. Returns its exit code. A replacement's ranks carry
    their process set's number (`incarnation`), as the local launcher's do."""
    host = ready["host"]
    worker_env = {
        **os.environ,
        env_names.STORE_ADDR: f"{host}:{ready['store_port']}", env_names.CONTROL_ADDR: f"{host}:{ready['control_port']}",
        env_names.REPLICA: str(task.replica), env_names.T0: repr(ready["t0"]), JOIN_TOKEN_ENV: ready["join_token"],
        env_names.WORKER_STARTED: repr(time.time()),
    }
    if task.ranks_per_replica > 1:  # as the local launcher starts a replica's ranks
        worker_env.update({env_names.LOCAL_RANK: str(task.local_rank),
                           env_names.RANKS_PER_REPLICA: str(task.ranks_per_replica),
                           env_names.REPLICAS: str(task.spec.replicas)})
    if incarnation:  # a replacement's groups inside its replica must not meet its predecessor's store keys
        worker_env[env_names.INCARNATION] = str(incarnation)
    if system.on_slurm == "requeue":  # every start trains at full size from the last complete checkpoint
        worker_env.update(RECOVER_MEMBERS=",".join(map(str, members)), RECOVER_ATTEMPT=str(task.restart))
    config_path = task.out / "config.json"
    if system.on_slurm == "agents":  # this task is a node: its torchrun agent, which starts the worker
        return _run_agent(task.spec, root, task.out, config_path, task.replica,
                          f"recover-{task.job_id}-{task.restart}", worker_env)
    worker = subprocess.Popen(
        [sys.executable, "-m", system.worker_module, "--config", str(config_path), "--replica", str(task.replica)],
        env=worker_env,
    )
    return worker.wait()


def _finish_run(task: SlurmTask, system: Any, coordinator: subprocess.Popen, ready: dict, members: list[int],
                code: int, replacements: Any = None) -> dict[str, Any]:
    """Task 0, after its own rank: keep the coordinator until the run is over (its `replacements`
    replacing lost replicas meanwhile, when the run has `replace_after`), requeue the job
    (checkpoint-restart) or write the run's summary.json."""
    sync, out, spec = task.sync, task.out, task.spec
    # A "recover" coordinator exits by itself; a bare store waits for every rank's done marker
    # (or a failure, fail-fast).
    failed: dict[str, int] = {}
    while coordinator.poll() is None:
        done = {p.name: int(p.read_text() or 1) for p in sync.glob("done-*")}
        failed = {k: c for k, c in done.items() if c != 0}
        if system.fail_fast and failed:
            break
        if system.coordinator_mode != "recover" and len(done) >= task.ranks:  # a store, a lighthouse
            break
        time.sleep(0.5)
    if coordinator.poll() is None:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(30)
    if replacements is not None:
        replacements.close()  # none left queued or running; a running one's ranks have reported their exit
    settings = spec.settings_obj()
    if failed and system.on_slurm == "requeue" and task.restart < settings.max_restarts:
        # the job's other ranks fail within moments of the first (their collectives break):
        # give them that long, so the notice names who was lost rather than who noticed
        end = time.time() + 3
        while time.time() < end and len(list(sync.glob("done-*"))) < task.ranks:
            time.sleep(0.2)
        done = {int(p.name.split("-")[1]): int(p.read_text() or 1) for p in sync.glob("done-*")}
        _requeue(out, task.restart, done, members, ready["t0"], settings.restart_mode)  # does not return: Slurm ends and restarts the job
    (out / PLAN_INPUT).unlink(missing_ok=True)  # the run saved its own copy, fault_plan.json
    committed = len(read_metrics(out / "metrics.jsonl"))
    ok = committed == spec.steps and (coordinator.returncode == 0 or system.coordinator_mode != "recover")
    extra = {"restarts": task.restart} if system.on_slurm == "requeue" else {}
    if replacements is not None:
        extra["replacements"] = replacements.record()
    extra.update(read_finals(out))  # every finisher's weights checksum, a replacement's among them
    elastic = out / "baseline" / "elastic.json"  # the agents' restarts, numbered by the workers' rank 0
    if system.on_slurm == "agents" and elastic.exists():
        extra["restarts"] = json.loads(elastic.read_text())["generation"]
    summary = write_summary(out, "ok" if ok else "failed", time.time() - ready["t0"], returncode=code,
                            reason="" if ok else f"{committed} of {spec.steps} steps committed", slurm_job=task.job_id,
                            **extra)
    return {"rank": 0, "returncode": code, "status": summary["status"]}


def _replacements(task: SlurmTask, system: Any, ready: dict, root: str, replace: dict[str, Any] | None) -> Any:
    """Task 0's replacer of lost replicas, when the run replaces them (recover with replace_after >= 0)."""
    train = json.loads((task.out / "config.json").read_text())["train"]  # as the run resolved it
    if not replace or system.coordinator_mode != "recover" or train["replace_after"] < 0:
        return None
    from .slurm_replacements import ReplaceOptions, SlurmReplacements

    return SlurmReplacements(task, root, ReplaceOptions(**replace), float(train["replace_after"]),
                             float(train["reconnect_timeout"]), ready["t0"], replacement_task)


def _run_agent(spec: RunSpec, root: str, out: Path, config_path: Path, rank: int, run_id: str,
               env: dict[str, str]) -> int:
    """elastic: this task's `torchrun` agent (one per node, c10d rendezvous on task 0's store, which
    no agent hosts), as the local supervisor starts it; a replica_loss of this node's worker takes
    the agent too (baselines.elastic.LostNodes), as losing a node would. Returns the agent's exit."""
    from recover.baselines.elastic import LostNodes, torchrun_argv

    args = torchrun_argv(spec.train_config(root), spec.settings_obj(), config_path, run_id)
    # torchrun_argv advertises 127.0.0.1 (its agents share a machine): here each agent is on its node
    node = coordinator_host(os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    args[args.index("--local-addr") + 1] = node
    agent = subprocess.Popen([sys.executable, "-m", "recover.baselines.elastic_agent", *args],
                             env={**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"})
    lost = LostNodes(out)
    lost.on_start({rank: [agent.pid]}, 0.0)
    while agent.poll() is None:
        lost.on_tick(0.0)
        time.sleep(0.2)
    return agent.returncode


def _coordinator_argv(spec: RunSpec, system: Any, config_path: Path) -> list[str]:
    """Task 0's coordinator process: torchft's lighthouse for torchft, else recover's coordinator."""
    if system.coordinator_mode == "torchft-lighthouse":  # it binds a port of its own and says which
        s = spec.settings_obj()
        return [sys.executable, "-m", "recover.baselines.torchft_lighthouse", "--host", "0.0.0.0",
                "--min-replicas", str(s.torchft_min_replicas), "--join-timeout-ms", str(s.torchft_join_timeout_ms),
                "--heartbeat-timeout-ms", str(s.torchft_heartbeat_timeout_ms)]
    return [sys.executable, "-m", COORDINATOR, *coordinator_args(config_path, system.coordinator_mode, host="0.0.0.0",
                                                                 store_port=0, control_port=0)]


def _first_start(spec: RunSpec, root: str, out: Path, config_path: Path) -> None:
    """Task 0 of a run's first start: a clean run directory, config.json and the fault plan."""
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "baseline", ignore_errors=True)  # never resume another run's checkpoints
    (out / "baseline").mkdir()
    (out / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    spec.write_plan(root)
    cfg = spec.train_config(root)
    plan = attach_plan(cfg)  # points cfg.hooks at the injector when there is a plan
    config = resolved_config_dict(cfg)
    settings = spec.settings_obj()
    if settings is not None:
        config["baseline"] = settings.to_dict()
    config_path.write_text(json.dumps(config, indent=2))
    if plan is not None:
        plan.save(out / "fault_plan.json")  # the workers' injectors read it there


def _members(spec: RunSpec, system: Any, out: Path, restart: int) -> list[int]:
    """The replicas that train in this start: all of them, except in a survivors-mode run
    restarted by requeue, where those named lost by earlier starts' fault notices stay out."""
    everyone = list(range(spec.replicas))
    settings = spec.settings_obj()
    if system.on_slurm != "requeue" or restart == 0 or getattr(settings, "restart_mode", "") != "survivors":
        return everyone
    lost: set[int] = set()
    for n in range(1, restart + 1):
        lost.update(json.loads(fault_notice_path(out, n).read_text())["failed_replicas"])
    return [r for r in everyone if r not in lost]


def _requeue(out: Path, restart: int, done: dict[int, int], members: list[int], t0: float, mode: str) -> None:
    """Leave the next start its fault notice (as the local supervisor does), then requeue this job.

    The lost replicas: those whose worker a signal ended, else those whose task left no
    exit at all (gone with its node), else every one that failed."""
    failed = sorted(r for r in members if done.get(r, 1) != 0)
    lost = ([r for r in failed if done.get(r, 0) < 0] or [r for r in members if r not in done] or failed)
    notice = {"fault": "; ".join(f"replica {r} " + (f"exited {done[r]}" if r in done else "gone") for r in failed),
              "failed_replicas": lost, "detected_at": time.time() - t0, "restart_mode": mode, "restarted_by": "slurm requeue",
              "relaunched_at": time.time() - t0}
    path = fault_notice_path(out, restart + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(notice))
    job = os.environ["SLURM_JOB_ID"]  # this array element's own id
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
    time.sleep(600)  # Slurm ends this task with the job
    raise RuntimeError(f"scontrol requeue {job} did not end the job within 10 minutes")


# ---- submitting a grid ----------------------------------------------------------------------
def _report_job_failure(name: str, job: Any, err: BaseException) -> Outcome:
    try:
        log = str(job.paths.stderr)
    except Exception:  # the debug executor has no files
        log = "(in-process job: see the traceback above)"
    return Outcome(name, "failed", f"job {job.job_id} raised {type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}; log: {log}")


def submit_grid(grid: Grid, executor: str, root: str | Path = "results", logs_root: str | Path = "runs/experiments",
                folder: str | Path = "runs/submitit", parallel: int = 1, slurm: SlurmOptions | None = None,
                wait: bool = True, timeout_min: int = 60, echo=print) -> list[Outcome]:
    """Launch the grid's incomplete runs (see the module docstring); return one Outcome per run."""
    import submitit

    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose from {', '.join(EXECUTORS)}")
    root, logs_root = str(root), str(logs_root)
    outcomes: list[Outcome] = []
    todo: list[RunSpec] = []
    for spec in grid.runs:
        if is_complete(spec.out_dir(root), spec.steps):
            outcomes.append(Outcome(spec.name, "skipped", "already complete"))
        else:
            todo.append(spec)
    if executor == "slurm":
        return outcomes + _submit_slurm(todo, root, folder, slurm or SlurmOptions(), wait, echo)
    ex = submitit.AutoExecutor(folder=str(folder), cluster=executor)
    if executor == "local":
        ex.update_parameters(timeout_min=timeout_min, name=f"recover-{grid.experiment}")
    step = max(1, parallel) if executor == "local" else max(1, len(todo))
    for i in range(0, len(todo), step):
        chunk = todo[i:i + step]
        jobs = ex.map_array(run_one, [s.to_dict() for s in chunk], [root] * len(chunk), [logs_root] * len(chunk))
        for spec, job in zip(chunk, jobs):
            try:
                r = job.result()
            except Exception as e:  # the job itself died (not the training: that is a status)
                outcomes.append(_report_job_failure(spec.name, job, e))
            else:
                detail = "" if r["status"] == "ok" else f"{r['reason']}; logs: {r['logs']}"
                outcomes.append(Outcome(spec.name, r["status"], detail))
            echo(f"  {outcomes[-1].status:>7}  {spec.name}  {outcomes[-1].detail}".rstrip())
    return outcomes


def slurm_shape(spec: RunSpec, opts: SlurmOptions) -> tuple[int, int, int]:
    """(nodes, tasks per node, GPUs per node) of a run's job: one task per rank, a replica's ranks
    on one node (a node holds whole replicas: a node that fails takes whole replicas with it).

    The tasks per node are `opts.tasks_per_node`, else the GPUs per node, else every rank of
    the run (CPU-only), rounded down to whole replicas, and never fewer than one replica's
    ranks. Raises ValueError when one replica needs more GPUs than a node has."""
    gpn = spec.gpus_per_node if opts.gpus_per_node is None else opts.gpus_per_node
    per_replica = spec.layout().ranks
    ranks = spec.replicas * per_replica
    if gpn > 0 and per_replica > gpn and opts.tasks_per_node is None:
        raise ValueError(f"a replica of {per_replica} ranks does not fit a node of {gpn} GPUs: its ranks "
                         f"run on one node here (lower --shard/--tp/--pp, or pass --tasks-per-node)")
    want = opts.tasks_per_node or (gpn if gpn > 0 else ranks)
    per_node = min(max(want // per_replica, 1) * per_replica, ranks)
    nodes = -(-ranks // per_node)
    return nodes, per_node, gpn


def _replacement_options(spec: RunSpec, opts: SlurmOptions, folder: str | Path, params: dict[str, Any]) -> dict[str, Any]:
    """How the run's task 0 submits a replacement job (experiments/slurm_replacements.py): one node,
    the replica's K ranks, the run's job's other Slurm options (no array, no requeue)."""
    k = spec.layout().ranks
    one = {key: v for key, v in params.items() if key not in ("nodes", "tasks_per_node", "slurm_array_parallelism",
                                                               "gpus_per_node", "slurm_additional_parameters")}
    one.update(nodes=1, tasks_per_node=k)
    if params.get("gpus_per_node"):
        one["gpus_per_node"] = k  # one GPU per rank
    extra = {key: v for key, v in params.get("slurm_additional_parameters", {}).items() if key != "requeue"}
    if extra:
        one["slurm_additional_parameters"] = extra
    return {"folder": str(folder), "params": one, "poll_s": opts.poll_s, "start_timeout_min": opts.start_timeout_min}


def _newest(folder: Path, pattern: str) -> str:
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else f"{folder}/{pattern}"


def _restarts(job_id: str) -> int:
    """How many times Slurm requeued the job (scontrol's Restarts=N; 0 when unknown)."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    for field_ in out.stdout.split():
        if field_.startswith("Restarts="):
            return int(field_.split("=", 1)[1])
    return 0


def _wait_slurm(name: str, job: Any, opts: SlurmOptions, echo=print) -> Outcome:
    """Wait for one run's job: task 0's result, or a clear failure (see the module docstring)."""
    task0 = job.task(0)
    log = task0.paths.stderr
    started = time.monotonic()
    while not task0.paths.result_pickle.exists():
        state = _job_state(job.job_id)
        if state not in SLURM_LIVE:
            time.sleep(2)  # a result written as the job ended may lag behind its state on a shared disk
            if task0.paths.result_pickle.exists():
                break
            return Outcome(name, "failed", f"job {job.job_id} ended {state} without task 0's result; log: {log}")
        # sacct keeps saying REQUEUED while a requeued job waits, and knows nothing ('') of an
        # array element that never started: squeue has the reason of all three
        if state in ("PENDING", "REQUEUED", ""):
            reason = _pending_reason(job.job_id)
            restarts = _restarts(job.job_id) if reason == "BeginTime" and opts.release_requeued else 0
            if restarts > 0:
                # Slurm holds a requeued job for 120 s before it may start again; the
                # failed tasks are gone already (they requeued it themselves), so start it now.
                done = subprocess.run(["scontrol", "update", f"jobid={job.job_id}", "StartTime=now"],
                                      capture_output=True, timeout=30)
                if done.returncode == 0:
                    echo(f"  job {job.job_id} requeued (restart {restarts}): started now, not after Slurm's 120 s hold")
            waited = (time.monotonic() - started) / 60
            if reason in NEVER_STARTS or (opts.start_timeout_min and waited > opts.start_timeout_min):
                job.cancel(check=False)
                why = (f"pending for a reason that will not pass ({reason})" if reason in NEVER_STARTS else
                       f"still pending after {waited:.1f} min ({reason or 'no reason given'})")
                return Outcome(name, "failed", f"job {job.job_id} cannot start: {why}; cancelled; script: "
                                               f"{job.paths.submission_file}; log (never written): {log}")
        time.sleep(opts.poll_s)
    try:
        r = task0.result()
    except Exception as e:  # the task raised: its traceback is in the log
        return _report_job_failure(name, task0, e)
    status = r.get("status", "failed")
    return Outcome(name, status, "" if status == "ok" else f"log {log}")


def _submit_slurm(todo: list[RunSpec], root: str, folder: str | Path, opts: SlurmOptions, wait: bool,
                  echo) -> list[Outcome]:
    import submitit
    from submitit.core.utils import FailedJobError

    outcomes: list[Outcome] = []
    runnable = []
    for spec in todo:
        if not SYSTEMS[spec.system].on_slurm:
            outcomes.append(Outcome(spec.name, "skipped",
                                    f"{spec.system} re-forms its job from a supervisor that starts local processes; "
                                    "not launched on Slurm yet"))
        else:
            try:
                slurm_shape(spec, opts)
            except ValueError as e:
                outcomes.append(Outcome(spec.name, "failed", str(e)))
                echo(f"  {'failed':>7}  {spec.name}  {e}")
                continue
            runnable.append(spec)
    submitted: list[tuple[RunSpec, Any]] = []
    # One array per job shape and per way of restarting (a requeued system's array goes --requeue).
    groups: dict[tuple[tuple[int, int, int], bool], list[RunSpec]] = {}
    for spec in runnable:
        groups.setdefault((slurm_shape(spec, opts), SYSTEMS[spec.system].on_slurm == "requeue"), []).append(spec)
    for ((nodes, per_node, gpn), requeue), specs in groups.items():
        ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
        params: dict[str, Any] = dict(
            name=f"recover-{specs[0].experiment}", nodes=nodes, tasks_per_node=per_node,
            cpus_per_task=opts.cpus_per_task, timeout_min=opts.time_min,
            slurm_array_parallelism=opts.array_parallelism,
        )
        if gpn > 0:
            params["gpus_per_node"] = gpn
        if opts.mem_gb > 0:
            params["mem_gb"] = opts.mem_gb
        if opts.partition:
            params["slurm_partition"] = opts.partition
        if opts.account:
            params["slurm_account"] = opts.account
        if opts.setup:
            params["slurm_setup"] = list(opts.setup)
        extra: dict[str, Any] = {}
        if opts.no_kill:
            extra["no-kill"] = True
            params["slurm_srun_args"] = ["--no-kill"]
        if requeue:
            extra["requeue"] = True  # a failure restarts the job from its last complete checkpoint
        if extra:
            params["slurm_additional_parameters"] = extra
        ex.update_parameters(**params)
        replace = [_replacement_options(s, opts, folder, params) for s in specs]
        try:
            jobs = ex.map_array(slurm_task, [s.to_dict() for s in specs], [root] * len(specs), replace)
        except FailedJobError as e:  # sbatch refused the array: nothing was queued
            why = " ".join(str(e).split()) or "no message"
            script = _newest(Path(folder), ".submission_file_*.sh")
            for spec in specs:
                outcomes.append(Outcome(spec.name, "failed", f"sbatch refused the job: {why}; script: {script}"))
                echo(f"  {'failed':>7}  {spec.name}  {outcomes[-1].detail}")
            continue
        for spec, job in zip(specs, jobs):
            outcomes.append(Outcome(spec.name, "submitted", f"job {job.job_id}; sbatch {job.paths.submission_file}; "
                                    f"log {job.task(0).paths.stderr}"))
            echo(f"  submitted  {spec.name}  job {job.job_id} ({nodes} node(s) x {per_node} task(s))")
            submitted.append((spec, job))
    if wait:  # every array is queued before the first wait: they run side by side
        for spec, job in submitted:
            outcomes.append(_wait_slurm(spec.name, job, opts, echo))
            echo(f"  {outcomes[-1].status:>7}  {spec.name}  {outcomes[-1].detail}".rstrip())
    return outcomes
