"""Micro-benchmarks of the hot paths (pytest-benchmark), run by `make bench`, never by `make test`.

They time, they do not judge: each asserts only that the benched call returned the
right answer, so a wrong fast path fails here instead of looking good. `make bench`
runs them serially (xdist disables pytest-benchmark), saves pytest-benchmark's JSON
under results/bench/micro/ and prints each figure beside the last saved run's
(`--benchmark-compare`): a regression shows as a ratio against its baseline.
`tests/test_bench_coordinator_cli.py` runs this file once with benchmarking
disabled, so a bench that no longer runs fails the suite.

What each one times, and why it is on the hot path:
- the quota policy over 512 replicas (every recovery and every speed change);
- the state machine's commit at 4,096 replicas (every step: R votes to one commit);
- the wire's parse of one vote: `parse_line` (the check alone, to a dict), and `read_line`,
  what the coordinator calls (R per step, on its one thread): the check and the read into its
  typed class (core/contract/step_messages.py); a worker's build of a vote's line, with its
  class (`Vote(...).to_line()`, what a worker sends) and, beside it, as the dict literal and
  orjson the code used before the classes (the plain version, so the two compare in one run);
- the weights digest and fingerprint of the small model (every --digest-every steps);
- one microbatch's forward/backward folded into the accumulator (every microbatch).
"""
from __future__ import annotations

import json

import pytest
import torch

from recover.core.contract import idranges, wire
from recover.core.worker.accumulator import GradAccumulator, weights_digest, weights_fingerprint
from recover.core.components.data import iteration_ids
from recover.core.components.model import GPT
from recover.core.contract.policy import assign_quotas, quota_of
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.contract.step_messages import Ready, Vote
from recover.core.storage.results import step_ids
from recover.core.config.shapes import model_config


def test_quota_policy_512_replicas(benchmark):
    ids = iteration_ids(7, 4096)
    speeds = {r: 1.0 + (r % 7) / 10 for r in range(512)}
    quotas = benchmark(assign_quotas, ids, list(range(512)), speeds)
    assert sorted(i for q in quotas.values() for i in q) == ids


def _formed(R: int, M: int) -> tuple[ProtocolStateMachine, dict[int, list]]:
    """Generation 0 of R replicas formed, and each one's quota as its worker reads it."""
    proto = ProtocolStateMachine(R, M, 2, join_timeout=30.0, now=0.0)
    gens = {}
    for r in range(R):
        for a in proto.on_hello(r, {"tokens_per_mb": 1}, 0.0):
            if a.kind == "send" and a.msg["t"] == "gen":
                gens[a.replica] = a.msg
    members = idranges.from_ids(range(R))
    return proto, {r: quota_of(msg, msg.get("members", members), r) for r, msg in gens.items()}


def test_state_machine_commit_4096_replicas(benchmark):
    """One step's R ready messages and R votes through the state machine, to its commit."""
    R, M = 4096, 4096 * 4

    def setup():
        # the messages as the service hands them over (wire.read_line reads them into their classes:
        # that read is timed by the parse benches below, the state machine's work here)
        proto, quotas = _formed(R, M)
        return (proto, [Ready(0, 0)] * R, [Vote(0, 0, True, quotas[r], 1.0, mb_seconds=0.1) for r in range(R)]), {}

    def one_step(proto, readies, votes):
        for r in range(R):
            proto.on_ready(r, readies[r], 0.0)
        out = []
        for r in range(R):
            out = proto.on_vote(r, votes[r], 0.0)
        return out

    out = benchmark.pedantic(one_step, setup=setup, rounds=5, iterations=1)
    commits = [a for a in out if a.kind == "commit"]
    assert len(commits) == 1 and step_ids(commits[0].msg) == iteration_ids(0, M)


def test_wire_parse_of_a_vote(benchmark):
    line = json.dumps({"t": "vote", "gen": 3, "step": 1200, "ok": True, "ledger": [[4800, 4804]],
                       "loss_sum": 10.25, "mb_seconds": 0.031, "lr": 0.0006}).encode()
    msg, why = benchmark(wire.parse_line, line)
    assert why == "" and msg["ledger"] == [[4800, 4804]]


_VOTE = Vote(3, 1200, True, [[4800, 4804]], 10.25, mb_seconds=0.031, progress_gap=0.01, lr=0.0006)


def test_build_of_a_vote_line(benchmark):
    """A worker's vote built with its class, as the line it sends (once per step per replica)."""
    def build():
        return Vote(3, 1200, True, [[4800, 4804]], 10.25, mb_seconds=0.031, progress_gap=0.01, lr=0.0006).to_line()
    assert benchmark(build) == wire.dumps(_VOTE.to_wire())


def test_build_of_a_vote_line_as_a_dict_literal(benchmark):
    """The same line as the code built it before the typed classes: the reference for the one above."""
    def build():
        return wire.dumps({"t": "vote", "gen": 3, "step": 1200, "ok": True, "ledger": [[4800, 4804]],
                           "loss_sum": 10.25, "mb_seconds": 0.031, "progress_gap": 0.01, "lr": 0.0006})
    assert benchmark(build) == _VOTE.to_line()


def test_parse_of_a_vote_line_to_message(benchmark):
    """A vote's line parsed, checked and read into its class, as the coordinator does (R per step)."""
    line = wire.dumps(_VOTE.to_wire())

    vote, why = benchmark(wire.read_line, line)
    assert why == "" and vote == _VOTE


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return GPT(model_config("small"))


def test_weights_digest_small_model(benchmark, small_model):
    params = list(small_model.parameters())
    digest = benchmark(weights_digest, params)
    assert digest == weights_digest(params) and len(digest) == 64


def test_weights_fingerprint_small_model(benchmark, small_model):
    params = list(small_model.parameters())
    fp = benchmark(weights_fingerprint, params)
    assert fp == weights_fingerprint(params)


def test_fold_one_microbatch_tiny_model(benchmark):
    """Forward, backward into the accumulator's .grad views, and the ledger's fold."""
    torch.manual_seed(0)
    cfg = model_config("tiny")
    model = GPT(cfg)
    acc = GradAccumulator(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    ids = iter(range(10**9))

    def fold_one():
        _, loss = model(x, x)
        loss.backward()
        acc.fold(next(ids), float(loss.detach()))

    benchmark(fold_one)
    assert len(acc.ledger) >= 1 and acc.buffer[:-1].abs().sum() > 0 and not acc.detached()
