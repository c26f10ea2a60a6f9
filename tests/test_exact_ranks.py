"""`--exact` at replicas of many ranks (`--shard`, `--tp`, `--pp`, `--pp` x `--shard`): recover
with a rank SIGKILLed mid-step is bit-identical to the same layout's failure-free `--exact` run.

Real processes: the failure-free run of a layout is the module's reference (one per
layout); the faulted run loses replica 1 to a SIGKILL of its rank 1 (not the leader) in
the backward of a microbatch, and the survivor redoes its ids. Both runs spike, in step 2,
the shard of rank 1 (a follower) of replica 0 beyond the normal fixed-point range (the
grad_spike fault): the replica agrees that the microbatch goes to the wide sums, which every
rank then all-reduces. Every step's loss must be
== the reference's, and every surviving rank's sha256 of its local shards (each replica's
`final/replica<r>.json` `shard_digests`, by local rank) == the reference's at the same
position. Equality across layouts is not claimed (docs/parallelism.md says why).
A part beyond the wide range at a follower stops the run naming the id, as at a leader.
Pure tests of the replica's agreement on a microbatch's band need no process.

With --pp, rank 1 is the last stage (PP2) or stage 0's second shard (PP2 x S2): the spike
and the crash strike a stage that is not the leader, and the survivor runs, in step 1, its
own two ids and then the dead replica's two, each through a schedule of its own: the
failure-free run's stage gradients, taken id by id, under another partition of the ids.

Budget: 7 runs of the tiny model, 2 replicas of 2 ranks, at most 3 steps; 2 more of 2
replicas of 4 ranks (PP2 x S2) with RECOVER_SLOW=1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import assert_every_planned_fault_fired, load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import reported_ids

M, STEPS, SEED = 4, 3, 5
COMMON = ["--system", "recover", "--replicas", "2", "--microbatches", str(M), "--steps", str(STEPS),
          "--seed", str(SEED), "--exact", "--heartbeat-timeout", "1.5", "--collective-timeout", "20", "--no-progress"]
LAYOUTS = {"shard": ["--shard", "2"], "tp": ["--tp", "2"], "pp": ["--pp", "2"],
           "pp_shard": ["--pp", "2", "--shard", "2"]}

# 8 processes a run: a minute a run on a busy 2-core machine, beyond the suite's budget
PP_SHARD = pytest.param("pp_shard", marks=[pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("RECOVER_SLOW"), reason="2 x (PP2 x S2) takes minutes; RECOVER_SLOW=1 runs it")])


# step 2's first id is microbatch 0 of replica 0 with 2 replicas or with 1 (contiguous quotas)
SPIKE = {"kind": "grad_spike", "replica": 0, "rank": 1, "step": 2, "phase": "backward", "microbatch": 0,
         "factor": 1e9}
CRASH = {"kind": "crash", "replica": 1, "rank": 1, "step": 1, "phase": "backward", "microbatch": 1}


def _run(out: Path, layout: str, faults: list[dict]) -> tuple[list[float], dict[int, list[str]]]:
    plan = out.parent / f"{out.name}_plan.json"
    plan.write_text(json.dumps({"faults": faults}))
    proc = run_recover("train", *COMMON, *LAYOUTS[layout], "--faults", str(plan), "--out", str(out), timeout=240)
    logs = "".join(p.read_text() for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    metrics = load_run(out)[1]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)  # each id once per step
    fired = assert_every_planned_fault_fired(out)
    assert "the next microbatch's gradient x 1e+09" in (out / "logs" / "replica0_rank1.log").read_text()
    pids = json.loads((out / "pids.json").read_text())["replicas"]
    for f, planned in zip(fired, faults):
        assert f["pid"] == pids[str(planned["replica"])][planned["rank"]]  # the rank itself, by its own PID
    finals = {}
    for f in (out / "final").glob("replica*.json"):
        rec = json.loads(f.read_text())
        finals[rec["replica"]] = rec["shard_digests"]
    return [m["loss"] for m in metrics], finals


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The failure-free run of each layout, built on first use."""
    cache: dict[str, tuple[list[float], list[str]]] = {}

    def get(layout: str) -> tuple[list[float], list[str]]:
        if layout not in cache:
            losses, finals = _run(tmp_path_factory.mktemp("ref") / layout, layout, [SPIKE])
            assert sorted(finals) == [0, 1] and finals[0] == finals[1]  # the replicas agree, rank by rank
            assert len(set(finals[0])) == len(finals[0]) >= 2  # every rank its own shard
            cache[layout] = (losses, finals[0])
        return cache[layout]

    return get


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["shard", "tp", "pp", PP_SHARD])
def test_a_rank_killed_mid_step_leaves_the_layouts_exact_trajectory(tmp_path, references, layout):
    ref_losses, ref_shards = references(layout)
    losses, finals = _run(tmp_path / "run", layout, [SPIKE, CRASH])
    assert losses == ref_losses  # bit for bit, every step
    assert finals == {0: ref_shards}  # the survivor's every shard, bit for bit; replica 1 is gone


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_a_followers_part_out_of_range_stops_the_run_naming_the_id(tmp_path):
    # x 1e30 puts rank 1's part of id 6 (step 1's first id of replica 1) beyond the wide range too;
    # the leader's own part fits, yet its vote names the id (the replica agreed), and the run stops
    out = tmp_path / "run"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{**SPIKE, "replica": 1, "step": 1, "factor": 1e30}]}))
    proc = run_recover("train", *COMMON, *LAYOUTS["shard"], "--faults", str(plan), "--out", str(out), timeout=150)
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
    assert proc.returncode == 1, proc.stdout + proc.stderr + "".join(logs.values())
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == [0]
    assert "step 1" in summary["reason"] and "[6]" in summary["reason"]
    assert "microbatch 6 is outside the exact fixed-point range: max |gradient element|" in logs["replica1_rank1.log"]
    assert "microbatch 6 is outside the exact fixed-point range: another rank's part" in logs["replica1.log"]


# ---- the replica's agreement, without processes ---------------------------------------------------

def _acc(others: int, counts_loss: bool = True):
    """An ExactAccumulator whose replica's other ranks say `others` for every microbatch's band."""
    from recover.core.worker.exact import ExactAccumulator

    class Acc(ExactAccumulator):
        def _agree(self, band: int) -> int:
            return max(band, others)

    p = torch.nn.Parameter(torch.zeros(4))
    acc = Acc([p], 4)
    acc.counts_loss = counts_loss
    return acc, p


def test_a_part_that_fits_is_summed_wide_when_another_rank_spiked():
    from recover.core.worker.exact import BAND_WIDE

    acc, p = _acc(BAND_WIDE)
    p.grad.copy_(torch.tensor([1.0, -2.0, 0.5, 0.0]))
    acc.fold(7, 1.5)
    reduced = acc.pack()
    assert acc.wide_needed(reduced) and int(reduced[-1]) == 0  # every rank reads one wide microbatch
    assert not reduced[:-3].any()  # nothing in the full-resolution sums
    acc.load_mean(reduced, 4, acc.pack_wide())
    assert torch.equal(p.grad, torch.tensor([1.0, -2.0, 0.5, 0.0]) / 4)


def test_a_part_that_fits_is_not_summed_when_another_rank_is_out_of_range():
    from recover.core.worker.exact import BAND_BAD, ExactRangeError

    acc, p = _acc(BAND_BAD)
    p.grad.fill_(1.0)
    acc.fold(3, 2.0)
    assert "another rank" in acc.out_of_range[3]
    reduced = acc.pack()
    assert int(reduced[-1]) == 1 and not reduced[:-3].any()  # counted bad, never summed
    assert acc.reduced_loss_sum(reduced) != acc.reduced_loss_sum(reduced)  # NaN: the vote names the id
    with pytest.raises(ExactRangeError):
        acc.load_mean(reduced, 4)


def test_a_rank_that_does_not_count_the_loss_adds_none_of_it():
    from recover.core.worker.exact import BAND_FULL

    acc, p = _acc(BAND_FULL, counts_loss=False)
    p.grad.fill_(0.25)
    acc.fold(0, 3.0)
    reduced = acc.pack()
    assert int(reduced[-3]) == 0 and acc.reduced_loss_sum(reduced) == 0.0
    assert acc.load_mean(reduced, 4) == 0.0 and torch.equal(p.grad, torch.full((4,), 0.0625))


def test_exact_with_a_baseline_at_many_ranks_is_refused_in_one_line():
    from recover.core.config.train_config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="plain and recover") as e:
        TrainConfig(system="ckpt-restart", replicas=2, microbatches=4, exact=True, shard=2).validate()
    assert "\n" not in str(e.value)
    TrainConfig(system="recover", replicas=2, microbatches=4, exact=True, shard=2).validate()
    TrainConfig(system="plain", replicas=2, microbatches=4, exact=True, shard=2).validate()
    TrainConfig(system="recover", replicas=2, microbatches=4, exact=True, tp=2).validate()
    TrainConfig(system="recover", replicas=2, microbatches=4, exact=True, pp=2).validate()
    TrainConfig(system="plain", replicas=2, microbatches=4, exact=True, pp=2, shard=2).validate()


# ---- --exact at --pp: one schedule per id, each taken before the next, without processes -----------

def test_an_exact_pipeline_runs_each_id_through_its_own_schedule_and_takes_it_before_the_next():
    from recover.core.parallel.pp import Pipeline

    pipe = Pipeline.__new__(Pipeline)  # the loop alone: `_run` (one torch schedule) is real-process tested above
    events, seen = [], []

    def one_schedule(ids, xs, ys, at):
        events.append(("run", list(ids), [int(x) for x in xs]))
        at("between_microbatches", 0)
        at("backward", 0)
        return [10.0 + ids[0]]

    pipe._run = one_schedule
    pipe.take = lambda mb, loss: events.append(("take", mb, loss))
    xs = [torch.tensor(7), torch.tensor(3)]
    losses = pipe.run([7, 3], xs, xs, lambda phase, k: seen.append((phase, k)))
    assert events == [("run", [7], [7]), ("take", 7, 17.0), ("run", [3], [3]), ("take", 3, 13.0)]
    assert losses == [17.0, 13.0]
    # the hooks count the ids of the whole call, as one schedule over both would
    assert seen == [("between_microbatches", 0), ("backward", 0), ("between_microbatches", 1), ("backward", 1)]


def test_an_exact_pipeline_accumulator_folds_only_ids_it_took_and_takes_each_once():
    from recover.core.parallel.fsdp import ExactPipelineAccumulator
    from recover.core.worker.accumulator import Ledger

    acc = ExactPipelineAccumulator.__new__(ExactPipelineAccumulator)  # the bookkeeping alone (no replica group)
    acc.ledger, acc._taken, summed = Ledger(), set(), []
    acc._sum_microbatch = lambda mb, loss: summed.append((mb, loss))
    with pytest.raises(ValueError, match="microbatch 5 was not taken"):
        acc.fold(5, 1.0)  # its gradient is not in the sums: never recorded as if it were
    acc.take(5, 2.0)
    with pytest.raises(ValueError, match="folded twice"):
        acc.take(5, 2.0)
    acc.fold(5, 2.0)
    with pytest.raises(ValueError, match="folded twice"):
        acc.take(5, 2.0)  # in the ledger now
    assert summed == [(5, 2.0)] and list(acc.ledger) == [5] and not acc._taken
