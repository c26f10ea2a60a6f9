"""The fault kinds: one table saying, for each kind, everything the harness and the simulator do with it.

Contract:
- `KINDS` maps a kind's name to a `FaultKind`, in the order plans, errors and
  `--help` list them. Every other module reads this table instead of testing
  kind names: plan.py validates with it, injector.py fires with it (worker side
  and launcher side), record.py records with it, generate.py draws with it, the
  drill settles with it, and experiments (sim/failures.py, aggregate.py) map it.
  Adding a kind is one entry here (and, for a parameter no kind had before, one
  `PARAMS` entry and the matching field of plan.Fault).
- A kind's parameters are fields of a fault beyond its target and trigger
  (today `seconds` and `factor`, described in `PARAMS`). A kind names those it
  `accepts` and those it `requires`; a plan giving a parameter its kind does not
  accept, or leaving out one it requires, fails validation naming that field.
  The accepted parameters are also what its faults.jsonl record carries.
- `at_phase`: a kind that only makes sense at one point (collective_error: the
  all-reduce in flight) must name that phase in a point trigger, and with a
  wall-clock trigger is armed until the worker next reaches that phase.
- Worker side: `worker(state, index, fault, step)` makes the fault real in the
  worker it targets, after its record is written (it may not return: SIGKILL,
  SIGSTOP, a raise). `on_restart(state, fault)`, when set, re-applies a fired
  fault's lasting effect in a worker that restarted (a straggler stays slow).
- `coordinator_signal`: a kind aimed at the coordinator process sends it this
  signal (`targets_coordinator`). The worker the plan names only pulls the
  trigger, at its step and phase, and signals the coordinator's PID from
  DIR/pids.json (which the launcher rewrites when it restarts one); at a
  coordinator phase the coordinator signals itself (injector.CoordinatorInjector).
  The record names the coordinator's PID.
- Launcher side: `launcher(pid, replica_pids)`, when set, fires a wall-clock
  fault of this kind from outside, by PID; kinds without one are armed in the
  worker whatever their trigger. `freezes`: the worker is stopped, not gone; the
  launcher SIGCONTs it once the record's `seconds` have passed, and without
  `seconds` it stays frozen for good.
- `leader_only` / `one_rank_only`, when set, say why the plan check refuses a
  fault of the kind at a rank other than 0 / in a run of replicas of many ranks
  (one line each); every other kind strikes any rank of a replica.
- `sample(hang_seconds=...)`, when set, gives the parameters of a fault of this
  kind drawn by generate.sample_plan; kinds without one are never drawn.
- Simulator: `sim_effect` is what the simulator makes of it (one of
  `SIM_EFFECTS`: "crash" the replica is out at once, "hang" it is out after a
  deadline, "none" not modelled, with `sim_why` saying why); plain data, so that
  experiments maps it and this folder never imports experiments.
  `loses_replica`: experiments/aggregate.py counts the replica as gone from the
  job from the moment the fault fired (its process-seconds).
- Nothing here imports torch, and nothing beyond core.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

SIM_EFFECTS = ("crash", "hang", "none")


class InjectedLinkError(RuntimeError):
    """The error an injected collective_error raises while the all-reduce is in flight."""


class InjectorState(Protocol):
    """What a worker-side action may read and change on the injector that fires it."""

    replica: int  # the replica this worker belongs to
    slow_factor: float  # every later microbatch takes this many times as long (1.0: normal speed)
    pace_seconds: float  # every later microbatch lasts at least this long (0.0: no floor)
    weights: Any  # the worker's weights as its trainer attached them (core.launch.hooks.Weights), or None
    link_broken_until: float  # until this time.time(), every all-reduce of this worker fails (0.0: link works)
    out: Path  # the run's directory (DIR/pids.json names the coordinator's PID)
    spoil_vote: bool  # the next vote goes out without its loss_sum (core.launch.hooks.WorkerHooks.outgoing_vote)


@dataclass(frozen=True)
class FaultParam:
    """A kind-specific field of a fault: how plan.py parses it and how it names it in errors."""

    name: str  # the field's name in the plan JSON and on plan.Fault
    minimum: float  # the smallest value allowed
    strict: bool  # True: the value must exceed `minimum`; False: may equal it
    needed_as: str  # completes "missing; a KIND fault needs ..."
    only: str  # "{owners}" becomes the kinds that accept it: "only a {owners} ..."


PARAMS: dict[str, FaultParam] = {p.name: p for p in (
    FaultParam("seconds", 0.0, True, "seconds (> 0: how long it lasts)", "only a {owners} lasts seconds"),
    FaultParam("factor", 1.0, False, "factor (>= 1: times as long, or times as large)",
               "only a {owners} fault has a factor"),
)}


@dataclass(frozen=True)
class FaultKind:
    """One fault kind: its parameters, what it does in the worker and the launcher, how it is drawn and simulated."""

    name: str  # the plan's "kind"
    doc: str  # one line: what happens to the target
    worker: Callable[[InjectorState, int, Any, int], None]  # (state, plan index, fault, step): make it happen
    accepts: tuple[str, ...] = ()  # kind-specific PARAMS it may have (and its record carries)
    requires: tuple[str, ...] = ()  # those of `accepts` it must have
    at_phase: str | None = None  # the only phase a point trigger may name; a wall-clock one waits for it
    at_phase_why: str = ""  # completes "a KIND ...: use PHASE" in the error for any other phase
    on_restart: Callable[[InjectorState, Any], None] | None = None  # re-apply a fired fault in a restarted worker
    launcher: Callable[[int, list[int]], None] | None = None  # (pid, replica's pids): fire a wall-clock one by PID
    freezes: bool = False  # the target is stopped, resumed after `seconds` (never, without)
    sample: Callable[..., dict[str, Any]] | None = None  # (hang_seconds=...) -> parameters of a drawn fault
    sim_effect: str = "none"  # one of SIM_EFFECTS
    sim_why: str = ""  # why the simulator models it so (shown when it is skipped)
    loses_replica: bool = False  # aggregate.py: the replica is out of the job from the moment it fired
    coordinator_signal: int | None = None  # the signal a kind aimed at the coordinator sends it (see the contract)
    leader_only: str = ""  # not '': only a replica's leader (rank 0) can be its target, and why
    one_rank_only: str = ""  # not '': refused in a run whose replicas have many ranks, and why

    @property
    def targets_coordinator(self) -> bool:
        return self.coordinator_signal is not None

    def __post_init__(self) -> None:
        # A table entry that cannot work fails at import, not when a plan first uses it.
        if self.sim_effect not in SIM_EFFECTS:
            raise ValueError(f"kind {self.name}: sim_effect {self.sim_effect!r} is not one of {SIM_EFFECTS}")
        for p in self.accepts:
            if p not in PARAMS:
                raise ValueError(f"kind {self.name}: accepts {p!r}, which is not one of PARAMS {tuple(PARAMS)}")
        for p in self.requires:
            if p not in self.accepts:
                raise ValueError(f"kind {self.name}: requires {p!r} without accepting it")


# ---- worker-side actions (in the process the fault targets) -------------------------------------
def _kill_self(state: InjectorState, index: int, fault: Any, step: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stop_self(state: InjectorState, index: int, fault: Any, step: int) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)  # returns only once someone sends SIGCONT


def sleep_for_good(sleep: Callable[[float], None] = time.sleep) -> None:
    """Block this thread until the process ends. Not `time.sleep(float("inf"))`: that raises
    OverflowError at once, so a fault meant to hang for good crashed the rank instead."""
    while True:
        sleep(3600.0)


def _stall(state: InjectorState, index: int, fault: Any, step: int) -> None:
    # The training thread blocks (as in a user's schedule or a device sync) while the
    # process's other threads, its heartbeat among them, run on: alive, but doing no work.
    if fault.seconds is None:
        sleep_for_good()
    time.sleep(float(fault.seconds))


def _slow_down(state: InjectorState, index: int, fault: Any, step: int) -> None:
    state.slow_factor = float(fault.factor)


def _stay_slow(state: InjectorState, fault: Any) -> None:
    state.slow_factor = float(fault.factor)


def _set_pace(state: InjectorState, index: int, fault: Any, step: int) -> None:
    state.pace_seconds = float(fault.seconds)


def _keep_pace(state: InjectorState, fault: Any) -> None:
    state.pace_seconds = float(fault.seconds)


def _break_link(state: InjectorState, index: int, fault: Any, step: int) -> None:
    raise InjectedLinkError(
        f"injected collective_error (fault {index}): replica {state.replica} lost its link at step {step}"
    )


def _flip_a_bit(state: InjectorState, index: int, fault: Any, step: int) -> None:
    if state.weights is None:
        raise RuntimeError(f"bitflip (fault {index}): this trainer attached no weights to its hooks")
    what = state.weights.flip_bit()
    print(f"bitflip (fault {index}) at step {step}: {what}", file=sys.stderr, flush=True)  # the worker's log
def _spike_gradient(state: InjectorState, index: int, fault: Any, step: int) -> None:
    # Fired before the backward of the named microbatch: the accumulator multiplies that
    # microbatch's gradient by `factor` when it folds it (core/worker/exact.py's test hook).
    spike = getattr(state.weights, "spike_next_fold", None)
    if spike is None:
        raise RuntimeError(f"grad_spike (fault {index}): this trainer's accumulator has no spike hook "
                           f"(it needs --exact)")
    spike(float(fault.factor))
    print(f"grad_spike (fault {index}) at step {step}: the next microbatch's gradient x {fault.factor:g}",
          file=sys.stderr, flush=True)  # the worker's log


def _break_link_for_good(state: InjectorState, index: int, fault: Any, step: int) -> None:
    # Not only this all-reduce: every later one fails too (the injector checks the
    # deadline at each "allreduce" point), so retrying with the same members cannot help.
    lasts = "for good" if fault.seconds is None else f"for {fault.seconds:g}s"
    state.link_broken_until = float("inf") if fault.seconds is None else time.time() + float(fault.seconds)
    raise InjectedLinkError(
        f"injected broken_link (fault {index}): replica {state.replica}'s link broke at step {step}, {lasts}"
    )


def _spoil_next_vote(state: InjectorState, index: int, fault: Any, step: int) -> None:
    # Fired at "vote", just before this step's vote is built: the injector's outgoing_vote
    # drops the vote's loss_sum, a malformed message from a peer that holds the join token.
    state.spoil_vote = True


def link_still_broken(state: InjectorState) -> None:
    """At an "allreduce" point: raise while a broken_link that already fired lasts."""
    if state.link_broken_until and time.time() < state.link_broken_until:
        raise InjectedLinkError(f"injected broken_link: replica {state.replica}'s link is still broken")


def kill_own_replica() -> None:
    """SIGKILL every process of this replica's process group, this one included."""
    pgid = os.getpgid(0)
    # The launcher gives each replica a group of its own. A group shared with our
    # parent would be the launcher's (or a test runner's): never signal that one.
    if pgid != os.getpgid(os.getppid()):
        os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_own_replica(state: InjectorState, index: int, fault: Any, step: int) -> None:
    kill_own_replica()


def coordinator_pid(out: Path) -> int:
    """The PID of the run's current coordinator, as the launcher last wrote it in DIR/pids.json."""
    return int(json.loads((Path(out) / "pids.json").read_text())["coordinator"])


def _signal_coordinator(state: InjectorState, index: int, fault: Any, step: int) -> None:
    # A SIGSTOP is for good: the launcher sees the coordinator stop beating and kills it
    # (core/launch/launcher.py), and the workers see its silence; no SIGCONT (that is what `freezes` does).
    os.kill(coordinator_pid(state.out), fault.spec.coordinator_signal)


def _set_own_node_down(state: InjectorState, index: int, fault: Any, step: int) -> None:
    # A node failure as Slurm sees one: the node that runs this task is set DOWN, and
    # Slurm itself ends every task on it (this one included). The training thread then
    # waits to be ended: it is the node going down that takes the replica, not this process.
    node = os.environ.get("SLURMD_NODENAME")
    if not node:
        raise RuntimeError(f"node_down (fault {index}): replica {state.replica} is not a Slurm task (no "
                           "SLURMD_NODENAME); a node_down fault needs `recover experiment --executor slurm`")
    reason = f"recover fault {index}: node_down of replica {state.replica} at step {step}"
    done = subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:  # e.g. a user who is not a Slurm operator
        raise RuntimeError(f"node_down (fault {index}): scontrol could not set {node} down: "
                           f"{(done.stderr or done.stdout).strip()}")
    print(f"node_down (fault {index}) at step {step}: set Slurm node {node} down", file=sys.stderr, flush=True)
    sleep_for_good()


# ---- launcher-side actions (by PID, from outside) -----------------------------------------------
def _kill_pid(pid: int, pids: list[int]) -> None:
    os.kill(pid, signal.SIGKILL)


def _stop_pid(pid: int, pids: list[int]) -> None:
    os.kill(pid, signal.SIGSTOP)


def _kill_replica(pid: int, pids: list[int]) -> None:
    pgid = os.getpgid(pid)
    if pgid != os.getpgrp():
        os.killpg(pgid, signal.SIGKILL)
    # and every process the launcher knows of the replica: a replica of many ranks is
    # several process groups (one per rank), all of which go at once
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- the table ----------------------------------------------------------------------------------
KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind(
        "crash", "SIGKILL of the target process", _kill_self,
        launcher=_kill_pid, sample=lambda **_: {}, sim_effect="crash", sim_why="the process is gone",
        loses_replica=True,
    ),
    FaultKind(
        "hang", "SIGSTOP of the target process, SIGCONT after `seconds` (frozen for good without)", _stop_self,
        accepts=("seconds",), launcher=_stop_pid, freezes=True,
        sample=lambda hang_seconds=None, **_: {"seconds": hang_seconds},
        # A hang that ends is still fenced out by recover, and still trips the baselines'
        # deadline: the simulator treats every hang as lasting past the deadline.
        sim_effect="hang", sim_why="the replica is fenced out at its deadline", loses_replica=True,
    ),
    FaultKind(
        "stall", "the target's training thread blocks for `seconds` (for good without) while its heartbeat "
        "goes on: alive but stuck (recover fences it once it shows no progress past its bound)", _stall,
        accepts=("seconds",),
        sim_effect="hang", sim_why="the replica is fenced out at its deadline", loses_replica=True,
    ),
    FaultKind(
        "slow", "every later microbatch takes `factor` times as long (a straggler)", _slow_down,
        accepts=("factor",), requires=("factor",), on_restart=_stay_slow,
        sim_effect="none", sim_why="it changes speed, not membership",
    ),
    FaultKind(
        # A big model's microbatch time on the tiny one: a floor, not a factor, so the
        # time a quota takes is known whatever the machine's load.
        "pace", "every later microbatch lasts at least `seconds` (a slow model, deterministic)", _set_pace,
        accepts=("seconds",), requires=("seconds",), on_restart=_keep_pace,
        sim_effect="none", sim_why="it changes speed, not membership",
    ),
    FaultKind(
        "collective_error", "the all-reduce in flight fails, as a broken link would", _break_link,
        at_phase="allreduce", at_phase_why="breaks the collective in flight",
        sim_effect="crash", sim_why="the replica leaves the collective",
    ),
    FaultKind(
        # Silent data corruption: nothing fails, the weights are just wrong from now on.
        "bitflip", "one bit of one weight flips in place (silent data corruption; recover's vote digests catch it)",
        _flip_a_bit,
        # recover fences the replica at its next digested vote; the baselines never notice
        # At any rank of a replica of many ranks: the vote's digest sums every rank's shard.
        sim_effect="crash", sim_why="recover fences the replica at its next weights digest", loses_replica=True,
    ),
    FaultKind(
        # A numerical fault: with --exact the gradient leaves the fixed-point range and the
        # step must be stopped or skipped, never committed wrapped (core/worker/exact.py).
        "grad_spike", "the gradient of the named microbatch is multiplied by `factor` (a gradient spike; "
        "needs --exact)", _spike_gradient, accepts=("factor",), requires=("factor",),
        at_phase="backward", at_phase_why="scales the gradient that backward is about to compute",
        sim_effect="none", sim_why="it changes a gradient, not membership",
        # At any rank of a replica of many ranks (--shard, --tp): it scales that rank's shard, and
        # the replica agrees on the microbatch's band (core/parallel/fsdp.py ExactShardedAccumulator).
    ),
    FaultKind(
        # A persistent fault: recover must exclude the replica (core.coordinator.fencing),
        # since re-forming the same members fails the same way every time.
        "broken_link", "every all-reduce of the target fails from then on, for `seconds` (for good without)",
        _break_link_for_good, accepts=("seconds",), at_phase="allreduce",
        at_phase_why="breaks the collective in flight (and every later one)",
        sim_effect="crash", sim_why="recover fences the replica after repeated failed collectives",
    ),
    FaultKind(
        # A member holding the join token sends a bad message: the
        # coordinator must fence the member, not crash or end the run.
        "bad_vote", "the target's vote goes out without its loss_sum (a malformed message from a member; recover "
        "fences the sender and its ids are redone)", _spoil_next_vote,
        at_phase="vote", at_phase_why="spoils the vote about to be sent",
        sim_effect="crash", sim_why="recover fences the sender at its vote", loses_replica=True,
        leader_only="only the leader sends the replica's vote",
    ),
    FaultKind(
        "replica_loss", "SIGKILL of the target replica's whole process group at once", _kill_own_replica,
        launcher=_kill_replica, sample=lambda **_: {}, sim_effect="crash", sim_why="the replica is gone",
        loses_replica=True,
    ),
    FaultKind(
        # A whole node lost the way a cluster loses one (Slurm runs only: experiments/launch_submitit).
        "node_down", "the Slurm node running the target is set DOWN (`scontrol update state=down`); Slurm ends "
        "every task on it, the target's among them", _set_own_node_down,
        sim_effect="crash", sim_why="the replica is gone with its node", loses_replica=True,
    ),
    FaultKind(
        "coordinator_crash", "SIGKILL of the coordinator process, pulled by the named worker at its step and phase "
        "(recover restarts the coordinator and rebuilds the run from its workers)", _signal_coordinator,
        coordinator_signal=signal.SIGKILL,
        sim_effect="none", sim_why="no replica is lost; the restart costs seconds, not modelled",
    ),
    FaultKind(
        "coordinator_hang", "SIGSTOP of the coordinator process for good, pulled by the named worker at its step "
        "and phase (recover's launcher kills it once it stops beating, and restarts it)", _signal_coordinator,
        coordinator_signal=signal.SIGSTOP,
        sim_effect="none", sim_why="no replica is lost; the restart costs seconds, not modelled",
    ),
)}

KIND_NAMES = tuple(KINDS)
LAUNCHER_KINDS = tuple(n for n, k in KINDS.items() if k.launcher is not None)
SAMPLE_KINDS = tuple(n for n, k in KINDS.items() if k.sample is not None)
