"""ParallelismArgs (core/parallel/args.py): the layout's sizes, and which layouts are refused before anything starts.

FSDP2 pads uneven dim-0 shards and lets a rank hold an empty one (checked on 2 gloo
ranks: a (1, 4) parameter over S=2 left rank 1 a (0, 4) shard, and AdamW stepped
both), so a shard size that divides nothing, or exceeds a parameter's dim 0, is
accepted; a 0-d parameter (fully_shard refuses it) and fewer rows per microbatch
than ranks per replica are not.
"""
from __future__ import annotations

import pytest
import torch

from recover.core.components.model import GPT
from recover.core.parallel.args import ParallelismArgs
from recover.core.config.shapes import GPTConfig


def test_sizes():
    a = ParallelismArgs(replicas=3, shard=2)
    assert (a.ranks_per_replica, a.world_size) == (2, 6)
    assert ParallelismArgs().world_size == 1


@pytest.mark.parametrize("replicas, shard, field", [(0, 1, "--replicas"), (1, 0, "--shard"), (2, -1, "--shard"),
                                                    (1.5, 1, "--replicas"), (1, True, "--shard")])
def test_sizes_below_one_or_not_integers_are_refused(replicas, shard, field):
    with pytest.raises(ValueError, match=field):
        ParallelismArgs(replicas=replicas, shard=shard).validate()


def test_uneven_and_oversized_shards_are_accepted():
    # 3 rows over 2 ranks (2 + 1), 1 row over 4 ranks (1 + 0 + 0 + 0): FSDP2 pads.
    shapes = {"w": (3, 8), "gain": (1,)}
    assert ParallelismArgs(2, 2).validate(shapes).shard == 2
    ParallelismArgs(1, 4).validate(shapes)
    ParallelismArgs(1, 3).validate(GPT(GPTConfig()), batch_size=4)


def test_a_scalar_parameter_is_refused_when_sharded():
    shapes = [(4, 4), ()]
    with pytest.raises(ValueError, match="0-d"):
        ParallelismArgs(2, 2).validate(shapes)
    ParallelismArgs(2, 1).validate(shapes)  # S = 1 shards nothing


def test_fewer_rows_than_ranks_per_replica_is_refused():
    with pytest.raises(ValueError, match="--shard: each rank takes rows of a microbatch: --batch-size 2 is less than --shard 4"):
        ParallelismArgs(1, 4).validate(batch_size=2)
    ParallelismArgs(1, 2).validate(batch_size=2)


def test_a_model_without_trainable_parameters_is_refused():
    m = torch.nn.Linear(2, 2)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        ParallelismArgs(1, 2).validate(m)
