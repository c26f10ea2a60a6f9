"""How a checkpoint keys AdamW's state (core/training/checkpoint.py), in one process.

AdamW's state is saved flattened by parameter name ("optim.param_groups.<param>.lr"), so
pipeline stages, each with its own parameters in its groups, never write one key twice. A
checkpoint written before, with AdamW's own per-group lists ("optim.param_groups.0.params"),
still loads at a layout that wrote it: the weights, the moments and the schedule come back.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from recover.core.config.train_config import TrainConfig
from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.training.checkpoint import CheckpointSaver, TrainingState, load_checkpoint
from recover.core.training.workload import Workload


def _cfg() -> TrainConfig:
    return TrainConfig(replicas=1, microbatches=2, steps=2, corpus_bytes=200_000)


def _one_step() -> Workload:
    torch.set_num_threads(1)
    work = Workload(_cfg())
    for i in range(2):
        work.fold(i)
    work.apply(work.pack(), 2, 0)
    return work


def _keys(path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _assert_same_state(a: Workload, b: Workload) -> None:
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]), name
    assert a.stepper.committed == b.stepper.committed == 1


def test_adamw_state_is_keyed_by_parameter_name_and_loads_back(tmp_path):
    work = _one_step()
    ckpts = CheckpointDir(tmp_path / "ckpts")
    CheckpointSaver(ckpts, TrainingState.of(work), None, 0, use_async=False, keep=2).save(1, 0)
    keys = _keys(ckpts.path(1))
    assert "optim.state.blocks.1.mlp.fc.weight.exp_avg" in keys and "optim.param_groups.blocks.1.mlp.fc.weight.lr" in keys
    assert not any(k.startswith("optim.param_groups.0.") for k in keys)
    fresh = Workload(_cfg())
    load_checkpoint(TrainingState.of(fresh), ckpts.path(1))
    _assert_same_state(work, fresh)


def test_a_checkpoint_with_listed_param_groups_still_loads(tmp_path):
    work = _one_step()
    state = TrainingState.of(work)
    path = CheckpointDir(tmp_path / "ckpts").path(1)
    # what the saver wrote before AdamW's state was flattened: its own state dict, groups as lists
    sd = {"model": get_model_state_dict(work.model), "optim": get_optimizer_state_dict(work.model, work.optimizer),
          "schedule": work.stepper.state_dict(),
          "progress": {"step": 1, "next_microbatch_id": 2, "seed": state.seed, "microbatches": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    assert "optim.param_groups.0.params" in _keys(path)
    fresh = Workload(_cfg())
    load_checkpoint(TrainingState.of(fresh), path)
    _assert_same_state(work, fresh)
