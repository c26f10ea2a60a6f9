"""A replica of many ranks votes one fingerprint of every rank's shard, and names a follower's non-finite ids.

The pure parts: the ranks' int64 weight bit sums ride the replica's combine as
21/21/22-bit chunks in float64 (core/parallel/replica_link.py `to_chunks`/`from_chunks`),
checked against the plain Python-integer version beside them (hypothesis), negative
values and wraparound mod 2^64 included; the fingerprint of a one-rank replica is what
it was; the shards' sums add up to the whole model's; a flip in any shard moves it.
Then two real gloo ranks (one process each) run `ReplicaLink.combine` and `nonfinite_ids`.
"""
from __future__ import annotations

import hashlib
import math
import os
import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.contract.nonfinite import NonfiniteLosses
from recover.core.parallel.replica_link import (DIGEST_SLOTS, from_chunks, reference_slot_sums, to_chunks)
from recover.core.worker.accumulator import (GradAccumulator, fingerprint_of, flip_largest_bit, weights_bit_sums,
                                             weights_fingerprint)

INT64 = st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1)


def _chunked_sum(vectors: list[list[int]]) -> list[int]:
    """What the all-reduce of `to_chunks` does: add every rank's float64 chunks, then reassemble."""
    total = torch.zeros(3 * DIGEST_SLOTS, dtype=torch.float64)
    for v in vectors:
        total += to_chunks(torch.tensor(v, dtype=torch.int64))
    return from_chunks(total).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(INT64, min_size=0, max_size=150), min_size=1, max_size=8))
def test_the_chunked_float64_sum_is_the_int64_sum_mod_2_64(vectors):
    # ranks of one layout have vectors of one length; PP stages do not: any lengths are allowed
    assert _chunked_sum(vectors) == reference_slot_sums(vectors)


def test_extremes_wrap_as_int64_does():
    top, bottom = 2 ** 63 - 1, -(2 ** 63)
    cases = [[[top], [1]], [[bottom], [-1]], [[top], [top]], [[bottom], [bottom]], [[-1], [1]], [[top, bottom]]]
    for vectors in cases:
        got = _chunked_sum(vectors)
        assert got == reference_slot_sums(vectors)
    assert _chunked_sum([[top], [1]])[0] == bottom  # wrapped, as int64 arithmetic does
    assert _chunked_sum([[-1], [1]])[0] == 0


def test_the_host_bit_sum_is_torchs_widening_sum():
    """On the host the sums are NumPy's (faster): the same integers as torch's own
    `sum(dtype=torch.int64)` over the bits, for every width, for views that are not
    contiguous, for empty tensors, and where the int64 sum wraps."""
    torch.manual_seed(1)
    base = torch.randn(64, 33)
    cases = [base, base.t(), base[:, ::3], base.to(torch.bfloat16), base.to(torch.float16),
             base.to(torch.float64), torch.randn(0), torch.tensor(2.5)]
    for t in cases:
        bits = t.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        assert weights_bit_sums([t]).tolist() == [int(bits.sum(dtype=torch.int64))], (t.dtype, t.shape)
    top = torch.full((4,), 2 ** 62, dtype=torch.int64).view(torch.float64)  # 4 * 2^62 wraps to 0
    assert weights_bit_sums([top]).tolist() == [int(top.view(torch.int64).sum())] == [0]


def test_a_one_rank_fingerprint_is_unchanged():
    """sha256 of the stacked int64 per-tensor sums, exactly as before the sums were factored out."""
    torch.manual_seed(0)
    ts = [torch.randn(7, 3), torch.randn(5), torch.randn(0)]
    sums = torch.stack([t.reshape(-1).view(torch.int32).sum(dtype=torch.int64) for t in ts])
    assert weights_fingerprint(ts) == hashlib.sha256(sums.numpy().tobytes()).hexdigest()
    assert weights_fingerprint(ts) == fingerprint_of(weights_bit_sums(ts))
    acc = GradAccumulator([torch.nn.Parameter(t.clone()) for t in ts if t.numel()])
    assert acc.weights_fingerprint() == fingerprint_of(acc.weights_bit_sums())


def _shards(ts: list[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """Rank r's local shard of every tensor, split as FSDP2 splits dim 0 (an empty shard allowed)."""
    return [[torch.tensor_split(t, parts)[r] for t in ts] for r in range(parts)]


@pytest.mark.parametrize("parts", [2, 3])
def test_the_ranks_sums_add_up_to_the_whole_models_and_any_flip_moves_them(parts):
    torch.manual_seed(1)
    ts = [torch.randn(5, 4), torch.randn(2), torch.randn(1, 3)]  # (1, 3) over 2 or 3 ranks: empty shards
    shards = _shards(ts, parts)
    replica = _chunked_sum([weights_bit_sums(s).tolist() for s in shards])
    assert replica == reference_slot_sums([weights_bit_sums(ts).tolist()])  # the split does not matter
    for r in range(parts):  # a bit flipped in any rank's shard moves the replica's vector
        flipped = [[t.clone() for t in s] for s in shards]
        flip_largest_bit(flipped[r])
        assert _chunked_sum([weights_bit_sums(s).tolist() for s in flipped]) != replica
        flip_largest_bit(flipped[r])  # flipped back: equal again
        assert _chunked_sum([weights_bit_sums(s).tolist() for s in flipped]) == replica


def test_flip_largest_bit_passes_over_empty_shards_and_refuses_nothing_to_flip():
    t = torch.tensor([1.0, -3.0])
    what = flip_largest_bit([torch.zeros(0), t])
    assert "parameter 1" in what and t[1] != -3.0
    with pytest.raises(ValueError, match="every tensor is empty"):
        flip_largest_bit([torch.zeros(0)])


def test_nonfinite_held_and_marked_ids():
    losses = NonfiniteLosses()
    losses.record(4, 1.0)
    losses.record(5, float("nan"))
    assert losses.held([4, 5]) == {5}
    losses.mark([4])  # another rank's rows of id 4 were not finite
    assert losses.in_ledger([4, 5]) == [[4, 6]]  # half-open id ranges: 4 and 5
    assert losses.held([6]) == set()  # a new step's ledger: the old ids are gone


# ---- two real ranks ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from recover.core.parallel.replica_link import ReplicaLink

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    link = ReplicaLink(rank, 2, open_store=lambda: None)
    ts = [torch.full((3,), 1.5 + rank), torch.full((2,), -2.0)]
    ok, loss, slots = link.combine(rank == 0, 1.0 + rank, bit_sums=weights_bit_sums(ts))
    plain = link.combine(True, 2.0)
    nan_loss = float("nan") if rank == 1 else 0.5
    _, total, _ = link.combine(True, nan_loss)
    ids = link.nonfinite_ids([10, 11, 12], {11} if rank == 1 else set()) if not math.isfinite(total) else None
    q.put((rank, ok, loss, slots.tolist(), plain, ids, weights_bit_sums(ts).tolist()))
    dist.destroy_process_group()


@pytest.mark.procs
def test_two_ranks_combine_their_sums_and_name_a_followers_nonfinite_id():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        out = q.get(timeout=120)
        got[out[0]] = out[1:]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    expect = reference_slot_sums([got[0][5], got[1][5]])
    for r in range(2):
        ok, loss, slots, plain, ids, _ = got[r]
        assert ok is False and loss == 3.0  # rank 1's all-reduce "failed": both read it
        assert slots == expect
        assert plain == (True, 4.0, None)  # no bit sums given: no digest part, as before
        assert ids == [11]  # the follower's id, on the leader too
