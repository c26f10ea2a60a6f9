"""Tensor parallelism inside a replica (core/parallel/tp.py): the layout's checks, the
qkv regrouping, and a one-replica grid on real processes against single-process training.

With T ranks, each holds n_head / T heads' [q; k; v] rows of the fused qkv and 4C / T rows
of the MLP's fc; the layer norms and embeddings stay whole on every tp rank, and their
gradients come out equal there (computed from replicated activations), so the
cross-replica sum per position is right with no collective of ours.
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
from recover.core.parallel.tp import group_heads_by_rank, qkv_row_order
from recover.core.config.shapes import GPTConfig

WORKER = str(Path(__file__).with_name("tp_worker.py"))
sys.path.insert(0, str(Path(__file__).parent))


def test_sizes_count_tp():
    a = ParallelismArgs(replicas=2, shard=2, tp=2)
    assert (a.ranks_per_replica, a.world_size) == (4, 8)
    assert TrainConfig(shard=3, tp=2).ranks_per_replica == 6


@pytest.mark.parametrize("tp, match", [(3, "--tp: 3 does not divide the model.s 2 attention heads"), (0, "--tp"), (True, "--tp")])
def test_a_tp_that_does_not_fit_the_model_is_refused(tp, match):
    with pytest.raises(ValueError, match=match):
        ParallelismArgs(1, 1, tp).validate(GPTConfig())


def test_tp_must_divide_the_heads():
    # (T dividing the heads divides n_embd, so the MLP's 4 x n_embd too: the heads' check comes first)
    ParallelismArgs(1, 1, 2).validate(GPT(GPTConfig()))  # a model works as its config does
    ParallelismArgs(1, 1, 6).validate(GPTConfig(n_head=6, n_embd=12))
    with pytest.raises(ValueError, match="--tp: 4 does not divide the model.s 6 attention heads"):
        ParallelismArgs(1, 1, 4).validate(GPTConfig(n_head=6, n_embd=12))


def test_train_config_refuses_a_tp_that_does_not_fit_naming_the_flag():
    with pytest.raises(ConfigError, match="--tp: 3 does not divide the model's 2 attention heads"):
        TrainConfig(system="recover", replicas=2, microbatches=2, tp=3).validate()
    with pytest.raises(ConfigError, match="--tp: must be >= 1"):
        TrainConfig(system="recover", replicas=2, microbatches=2, tp=0).validate()
    TrainConfig(system="plain", replicas=2, microbatches=2, tp=2).validate()  # recover's failure-free reference
    TrainConfig(system="torchft", replicas=2, microbatches=2, tp=2).validate()  # its fault-tolerant HSDP, TP inside
    # --shard and --tp are built: their ranks write and load their shards
    TrainConfig(system="recover", replicas=2, microbatches=2, tp=2, checkpoint_every=2).validate()
    TrainConfig(system="recover", replicas=2, microbatches=2, shard=2, checkpoint_every=2).validate()
    TrainConfig(system="recover", replicas=2, microbatches=2, tp=2).validate()
    TrainConfig(system="recover", model="small", replicas=2, microbatches=2, tp=4).validate()


def test_qkv_rows_regrouped_per_rank_keep_each_heads_q_k_v_together():
    C, T = 8, 2
    order = qkv_row_order(C, T)
    assert sorted(order.tolist()) == list(range(3 * C))
    # rank 0's chunk: q rows 0..3, k rows 8..11, v rows 16..19; rank 1's the next halves
    assert order.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    lin = torch.nn.Linear(C, 3 * C, bias=True)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    group_heads_by_rank(lin, T)
    assert torch.equal(lin.weight, w[order]) and torch.equal(lin.bias, b[order])


def test_the_single_process_attention_is_unchanged_by_the_local_head_count():
    # the attention reads its head count from qkv's width: one process holds them all
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, 256, (2, 16))
    _, loss = model(x, x)
    attn = model.blocks[0].attn
    q, k, v = attn.qkv(torch.randn(1, 4, 64)).chunk(3, dim=2)
    assert q.shape[-1] // attn.head_dim == attn.n_head == 2
    assert torch.isfinite(loss)


def _run(out: Path, shard: int, tp: int, timeout: float = 240) -> list[dict]:
    run_ranks_around_a_store(lambda port: [
        [sys.executable, WORKER, str(port), str(out), str(i), str(shard), str(tp)] for i in range(shard * tp)], timeout)
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(shard * tp)]


def _reference():
    """Single-process: the same three microbatches, the gradients, the step's loss and checksum."""
    import tp_worker
    from recover.core.training.workload import Workload
    torch.set_num_threads(1)
    work = Workload(tp_worker.config())
    for i in tp_worker.IDS:
        work.fold(i)
    grads = {n: p.grad.detach().clone() for n, p in work.model.named_parameters()}
    loss_sum = work.acc.loss_sum
    mean, _ = work.apply(work.pack(), len(tp_worker.IDS), 0)
    return grads, loss_sum, mean, work.state_checksum()


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_one_replica_of_tp2_matches_single_process(tmp_path: Path):
    ranks = _run(tmp_path, 1, 2)
    grads, loss_sum, mean, checksum = _reference()
    # the grid: local rank = shard_index * T + tp_index, and the mesh agrees
    assert [(r["shard_index"], r["tp_index"], r["mesh_shard"], r["mesh_tp"]) for r in ranks] == \
        [(0, 0, 0, 0), (0, 1, 0, 1)]
    # parameters whole on each tp rank: equal gradients on both (DTensor did the TP reduction), equal to the reference
    assert ranks[0]["whole_grads"].keys() == ranks[1]["whole_grads"].keys()
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight", "ln_f.weight"} <= ranks[0]["whole_grads"].keys()
    for name, g in ranks[0]["whole_grads"].items():
        assert g == ranks[1]["whole_grads"][name], name  # bit for bit: the same computation on both
        torch.testing.assert_close(torch.tensor(g), grads[name].reshape(-1), rtol=1e-4, atol=1e-6)
    # the split layers: rank t holds its heads' [q; k; v] rows, and its half of fc's rows
    order = qkv_row_order(64, 2)
    qkv = grads["blocks.0.attn.qkv.weight"][order]
    fc = grads["blocks.0.mlp.fc.weight"]
    for t, r in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(r["qkv_grad"]), qkv[t * 96:(t + 1) * 96].reshape(-1),
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["fc_grad"]), fc[t * 128:(t + 1) * 128].reshape(-1),
                                   rtol=1e-4, atol=1e-6)
        assert r["detached"] == []
    # the loss: only tp index 0 counts it, so the replica's sum is each microbatch once
    assert ranks[1]["loss_part"] == 0.0
    assert ranks[0]["replica_loss_sum"] == pytest.approx(loss_sum, rel=1e-6)
    for r in ranks:
        assert r["mean_loss"] == pytest.approx(mean, rel=1e-6)
        assert r["checksum"] == pytest.approx(checksum, rel=1e-6)  # after a clipped step: clipping agrees


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_one_replica_of_shard2_x_tp2_matches_single_process(tmp_path: Path):
    ranks = _run(tmp_path, 2, 2)
    _, loss_sum, mean, checksum = _reference()
    assert [(r["shard_index"], r["tp_index"], r["mesh_shard"], r["mesh_tp"]) for r in ranks] == \
        [(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)]
    assert [r["loss_part"] == 0.0 for r in ranks] == [False, True, False, True]
    for r in ranks:
        assert r["replica_loss_sum"] == pytest.approx(loss_sum, rel=1e-6)
        assert r["mean_loss"] == pytest.approx(mean, rel=1e-6)
        assert r["checksum"] == pytest.approx(checksum, rel=1e-6)
        assert r["detached"] == []
