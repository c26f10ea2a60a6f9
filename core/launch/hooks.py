"""The hook interface through which code outside core/ reaches into a running worker.

Contract:
- core/ calls `WorkerHooks.at(step, phase, microbatch)` at every named point of an
  iteration (`PHASES`), and `microbatch_done(step, microbatch, seconds)` after each
  microbatch. The base class does nothing, so a run without hooks pays nothing.
- A hook may do anything a real fault does: kill or freeze its own process, sleep
  (a straggler), or raise (at "allreduce": the collective counts as failed, as a
  broken link would make it).
- A trainer that owns weights hands them over once with `attach_weights(weights)`
  (something with `flip_bit(bit) -> str`, e.g. core.worker.accumulator.GradAccumulator),
  so that a hook can corrupt them as silent data corruption would.
- The coordinator has one hook point of its own (`COORDINATOR_PHASES`):
  `CoordinatorHooks.after_send(msg, replica)` after each protocol message it sent,
  so a fault can kill it between two commit messages of one step (mid-commit).
  It is called only when a run has coordinator hooks (`TrainConfig.coordinator_hooks`).
- core/ never imports the implementations (fault_injection/ does): they are named
  by a "module:function" string in the config and loaded here by importlib, so the
  import direction stays fault_injection -> core.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from recover.core.config.train_config import TrainConfig

PHASES = (
    "forward",  # before the forward pass of a microbatch
    "backward",  # after the forward pass, before the backward pass
    "between_microbatches",  # after a microbatch's backward, before the next one
    "allreduce",  # while the gradient all-reduce is in flight
    "vote",  # after the all-reduce completed, before this replica's vote (or commit) is sent
    "commit",  # after this replica's vote, before the commit is known
    "optimizer_step",  # after the commit, before the optimizer step
    "checkpoint_save",  # while a checkpoint is being written (checkpointing systems)
    "state_transfer",  # recover, at an admission: the donor and each newcomer, just before the state moves
)

COORDINATOR_PHASES = (
    "commit_sent",  # the coordinator sent the step's commit to the named replica (and the members before it) only
)


class Weights(Protocol):
    """What a hook may do to a worker's weights."""

    def flip_bit(self, bit: int = ...) -> str:
        """Flip one bit of one weight in place; returns which."""
        ...


class WorkerHooks:
    """No-op hooks; subclass and override what you need."""

    def attach_weights(self, weights: Weights) -> None:
        """Called once by a trainer with the weights it trains (a hook may corrupt them)."""

    def at(self, step: int, phase: str, microbatch: int | None = None) -> None:
        """Called at `phase` of iteration `step` (`microbatch`: index within this replica's step)."""

    def microbatch_done(self, step: int, microbatch: int, seconds: float) -> None:
        """Called after the `microbatch`-th microbatch of `step` took `seconds`."""

    def outgoing_vote(self, vote: dict) -> dict:
        """Called with each vote just before it is sent; returns the message to send. Only a hooks
        class that overrides it is called: without one, a vote goes as encoded from its class
        (`Vote.to_line()`), with no dict built."""
        return vote


def load_hooks(spec: str, cfg: "TrainConfig", replica: int, rank: int = 0) -> WorkerHooks:
    """Build hooks from "module:function" (called as function(cfg, replica, rank)); '' = none."""
    if not spec:
        return WorkerHooks()
    module, _, func = spec.partition(":")
    factory = getattr(importlib.import_module(module), func)
    return factory(cfg, replica, rank)


class CoordinatorHooks:
    """No-op coordinator hooks; subclass and override what you need."""

    def after_send(self, msg: dict, replica: int) -> None:
        """Called after protocol message `msg` went to `replica` (only when hooks are set)."""


def load_coordinator_hooks(spec: str, cfg: "TrainConfig") -> CoordinatorHooks | None:
    """Build the coordinator's hooks from "module:function" (called as function(cfg)); '' = none."""
    if not spec:
        return None
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)(cfg)
