"""Pipeline parallelism inside a replica (core/parallel/pp.py): the layout's checks, the
stages' cut, and a one-replica pipeline on real processes against single-process training.

Each of P ranks holds a stage of the GPT; the token embedding (first stage) and the output
head (last stage) are one tied weight held twice, whose two gradients are summed after each
schedule run. torch's schedules run with scale_grads=False, so after two runs (a quota and a
redo) the accumulator holds the plain sum over the ids, exactly as one process folding them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_ranks_around_a_store

from recover.core.config.train_config import ConfigError, TrainConfig
from recover.core.components.model import GPT
from recover.core.parallel.args import ParallelismArgs
from recover.core.parallel.pp import GPTStage, stage_blocks
from recover.core.config.shapes import GPTConfig

WORKER = str(Path(__file__).with_name("pp_worker.py"))
sys.path.insert(0, str(Path(__file__).parent))


def test_sizes_count_pp_and_the_grid_order():
    a = ParallelismArgs(replicas=2, shard=2, tp=2, pp=3)
    assert (a.ranks_per_replica, a.world_size) == (12, 24)
    assert TrainConfig(pp=2).ranks_per_replica == 2
    assert ParallelismArgs().pp_schedule == TrainConfig().pp_schedule == "1f1b"


def test_a_pp_that_does_not_fit_the_model_is_refused():
    ParallelismArgs(1, 1, 1, 2).validate(GPTConfig())  # tiny: 2 layers
    with pytest.raises(ValueError, match="--pp: 3 stages, but the model has 2 layers"):
        ParallelismArgs(1, 1, 1, 3).validate(GPTConfig())
    with pytest.raises(ValueError, match="--pp: 3 stages, but the model has 2 layers"):
        ParallelismArgs(1, 1, 1, 3).validate(GPT(GPTConfig()))
    with pytest.raises(ValueError, match="--pp"):
        ParallelismArgs(1, 1, 1, 0).validate()
    with pytest.raises(ValueError, match="--pp-schedule"):
        ParallelismArgs(1, 1, 1, 2, "gpipe").validate()


def test_train_config_refuses_a_pp_that_does_not_fit_naming_the_flag():
    with pytest.raises(ConfigError, match="--pp: 3 stages, but the model has 2 layers"):
        TrainConfig(system="recover", replicas=2, microbatches=2, pp=3).validate()
    with pytest.raises(ConfigError, match="--pp: must be >= 1"):
        TrainConfig(system="recover", replicas=2, microbatches=2, pp=0).validate()
    with pytest.raises(ConfigError, match="--pp-schedule"):
        TrainConfig(system="recover", replicas=2, microbatches=2, pp=2, pp_schedule="zb").validate()
    TrainConfig(system="plain", replicas=2, microbatches=2, pp=2).validate()  # recover's failure-free reference
    with pytest.raises(ConfigError, match="^--system: torchft runs replicas split by S and TP only; 2 x PP2 needs"):
        TrainConfig(system="torchft", replicas=2, microbatches=2, pp=2).validate()
    # pipeline stages checkpoint (their state under the whole model's names; --resume: tests/test_pp_checkpoint.py)
    TrainConfig(system="recover", replicas=2, microbatches=2, pp=2, checkpoint_every=2).validate()
    TrainConfig(system="recover", replicas=2, microbatches=2, pp=2, shard=2).validate()  # FSDP2 stages
    TrainConfig(system="recover", replicas=2, microbatches=2, pp=2, pp_schedule="afab").validate()
    TrainConfig(system="recover", replicas=2, microbatches=2, pp=2, tp=2).validate()
    TrainConfig(system="recover", model="small", replicas=2, microbatches=2, pp=4).validate()


def test_stages_cut_the_blocks_contiguously_first_stages_one_more():
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError):
        stage_blocks(2, 3)


def test_stages_compose_to_the_whole_model_and_untie_the_head():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    s0, s1 = GPTStage(model, 0, 2), GPTStage(model, 1, 2)
    x = torch.randint(0, 256, (2, 16))
    logits, _ = model(x)
    torch.testing.assert_close(s1(s0(x)), logits)
    assert s1.head.weight is not model.tok_emb.weight and torch.equal(s1.head.weight, model.tok_emb.weight)
    assert s0.tied is model.tok_emb.weight and s1.tied is s1.head.weight
    assert s0.duplicates() == [] and s1.duplicates() == [s1.head.weight]


def test_stages_name_their_state_by_the_whole_models_names():
    # what a checkpoint's keys are (core/training/checkpoint.py): the model's layer numbers, not the stage's
    model = GPT(GPTConfig(n_layer=5))
    s0, s1 = GPTStage(model, 0, 2), GPTStage(model, 1, 2)  # blocks 0-2, 3-4
    assert s0.global_name("blocks.2.attn.qkv.weight") == "blocks.2.attn.qkv.weight"
    assert s1.global_name("blocks.0.attn.qkv.weight") == "blocks.3.attn.qkv.weight"
    assert s1.global_name("blocks.1") == "blocks.4"
    assert {s0.global_name(n) for n, _ in s0.named_parameters()}.isdisjoint(
        s1.global_name(n) for n, _ in s1.named_parameters())
    assert {s0.global_name(n) for n, _ in s0.named_parameters()} | {
        s1.global_name(n) for n, _ in s1.named_parameters()} == set(model.state_dict())
    # the last stage's copy of the tied weight takes the embedding's AdamW state where a checkpoint lacks its own
    assert s1.optimizer_fallback("head.weight.exp_avg") == "tok_emb.weight.exp_avg"
    assert s0.optimizer_fallback("tok_emb.weight.exp_avg") is None and s1.optimizer_fallback("ln_f.weight.step") is None


def _run(out: Path, pp: int, schedule: str, tp: int = 1, timeout: float = 240, shard: int = 1) -> list[dict]:
    n = pp * shard * tp
    run_ranks_around_a_store(lambda port: [
        [sys.executable, WORKER, str(port), str(out), str(i), str(pp), schedule, str(tp), str(shard)]
        for i in range(n)], timeout)
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(n)]


def _reference():
    """Single-process: the same microbatches, each one's loss, the gradient norm, the step's loss and checksum."""
    import pp_worker
    from recover.core.training.workload import Workload
    torch.set_num_threads(1)
    work = Workload(pp_worker.config())
    losses = [[work.fold(i) for i in ids] for ids in pp_worker.RUNS]
    norm = float(torch.nn.utils.clip_grad_norm_(work.acc.params, 1e9))
    mean, _ = work.apply(work.pack(), sum(map(len, pp_worker.RUNS)), 0)
    return losses, norm, mean, work.state_checksum()


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_one_replica_of_pp2_matches_single_process(tmp_path: Path, schedule: str):
    ranks = _run(tmp_path, 2, schedule)
    losses, norm, mean, checksum = _reference()
    assert [r["stage"] for r in ranks] == [0, 1]
    assert "tok_emb.weight" in ranks[0]["params"] and "head.weight" in ranks[1]["params"]
    for r in ranks:
        # every stage returns every id's loss (the last stage's, broadcast)
        for got, ref in zip(r["losses"], losses):
            assert got == pytest.approx(ref, rel=1e-5)
        assert r["norm"] == pytest.approx(norm, rel=1e-5)  # each parameter once, the tied one included
        assert r["mean_loss"] == pytest.approx(mean, rel=1e-6)
        assert r["checksum"] == pytest.approx(checksum, rel=1e-6)
        assert r["detached"] == []
    # the fault hooks, per stage, in the order the schedule ran them (both stages see every phase of every k)
    for r in ranks:
        seen = {tuple(p) for p in r["phases"]}
        assert {(ph, k) for ph in ("forward", "backward") for k in (0, 1)} <= seen


class _Hooks:
    def __init__(self):
        self.seen = []

    def at(self, step, phase, microbatch=None):
        self.seen.append((phase, microbatch))

    def microbatch_done(self, step, microbatch, seconds):
        self.seen.append(("done", microbatch))


def test_a_quota_stopped_early_runs_the_ids_it_gave_in_one_schedule_and_folds_them_all():
    from recover.core.worker.fold import fold_pipelined

    def quota():  # an abort between ids: quota() stops after handing out two of its four
        yield 7
        yield 3

    runs, folded, hooks = [], [], _Hooks()

    def run(ids, at):
        runs.append(list(ids))
        for i in range(len(ids)):
            at("between_microbatches", i)
            at("forward", i)
        return [10.0 + i for i in ids]

    fold_pipelined(2, quota(), run, hooks, first=1, after=lambda mb, loss: folded.append((mb, loss)))
    assert runs == [[7, 3]]  # one schedule over exactly the ids given
    assert folded == [(7, 17.0), (3, 13.0)]  # each folded, in order, with its own loss
    # k counts on from `first` (a redo after a recovery), and microbatch_done follows the run
    assert hooks.seen == [("between_microbatches", 1), ("forward", 1), ("between_microbatches", 2), ("forward", 2),
                          ("done", 1), ("done", 2)]
    hooks.seen.clear()
    fold_pipelined(0, iter([4]), run, hooks)
    assert hooks.seen == [("forward", 0), ("done", 0)]  # no "between" before a step's first microbatch
    runs.clear()
    fold_pipelined(0, iter([]), run, hooks)  # an abort before any id: no schedule at all
    assert runs == []


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_one_replica_of_pp2_x_tp2_matches_single_process(tmp_path: Path):
    ranks = _run(tmp_path, 2, "1f1b", tp=2)
    losses, norm, mean, checksum = _reference()
    # the grid: local rank = pp_index * T + tp_index (S = 1)
    assert [(r["stage"], r["tp_index"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        for got, ref in zip(r["losses"], losses):
            assert got == pytest.approx(ref, rel=1e-5)
        assert r["norm"] == pytest.approx(norm, rel=1e-5)
        assert r["mean_loss"] == pytest.approx(mean, rel=1e-6)
        assert r["checksum"] == pytest.approx(checksum, rel=1e-6)
        assert r["detached"] == []


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_one_replica_of_pp2_x_shard2_matches_single_process(tmp_path: Path):
    """FSDP2 stages: torch's stage setup sets .grad to None on FSDP modules, so each run's fresh
    gradients are added back into the accumulator's views (ShardedAccumulator.absorb_detached), and
    the tied head's copy is named a duplicate after FSDP2 replaced the parameters: each id once,
    the tied weight once, over two schedule runs (a quota and its redo)."""
    ranks = _run(tmp_path, 2, "1f1b", shard=2)
    losses, norm, mean, checksum = _reference()
    # the grid: local rank = pp_index * S + shard_index (T = 1)
    assert [(r["stage"], r["shard_index"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for s in (0, 1):  # each rank's losses are its rows' part: the two shard positions add up to the id's
        parts = [r["losses"] for r in ranks if r["stage"] == s]
        for run_a, run_b, ref in zip(*parts, losses):
            assert [a + b for a, b in zip(run_a, run_b)] == pytest.approx(ref, rel=1e-5)
    for r in ranks:
        assert r["norm"] == pytest.approx(norm, rel=1e-5)
        assert r["mean_loss"] == pytest.approx(mean, rel=1e-6)
        assert r["checksum"] == pytest.approx(checksum, rel=1e-6)
        assert r["detached"] == []
