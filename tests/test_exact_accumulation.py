"""Exact accumulation (core/worker/exact.py) without processes: the committed mean gradient and loss
depend only on the set of microbatch ids, bit for bit, whatever the partition over replicas
and the order of the folds; values outside the fixed-point range are refused, never wrapped.

The "replicas" here are ExactAccumulators over copies of one model; the all-reduce is the
sum of their packed int64 buffers (what gloo's SUM computes: integer addition is exact).
Each id's gradient is a fixed function of the id (a seeded random tensor written into
.grad, as a deterministic backward would), so the only thing that varies is who folds what.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.worker.exact import (
    ExactAccumulator,
    ExactRangeError,
    fixed_point_shift,
    from_fixed,
    to_fixed,
)

SHAPES = [(5, 3), (7,), (2, 2, 2)]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]


def _grad_of(mb_id: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Microbatch `mb_id`'s gradient: seeded, with magnitudes spread over many binades."""
    g = torch.Generator().manual_seed(1000 + mb_id)
    out = []
    for s in SHAPES:
        t = torch.randn(s, generator=g) * torch.exp2(torch.randint(-30, 4, s, generator=g).float())
        out.append(t * scale)
    return out


def _loss_of(mb_id: int) -> float:
    return float(torch.tensor(2.0 + math.sin(mb_id), dtype=torch.float32))


def _fold(acc: ExactAccumulator, mb_id: int, scale: float = 1.0) -> None:
    for p, g in zip(acc.params, _grad_of(mb_id, scale)):
        p.grad.add_(g)  # .grad views the accumulator's fp32 buffer, which holds one microbatch
    acc.fold(mb_id, _loss_of(mb_id))


SPIKED = {107, 111}  # ids whose gradient is a spike (x 2^20: beyond 2^12, inside the wide range)


def _committed(parts: list[list[int]], M: int, spiked: frozenset = frozenset()) -> tuple[bytes, float]:
    """The mean gradient's bytes and the mean loss, for ids folded by len(parts) replicas
    (the all-reduce: the sum of their packs, then of their wide sums when the count says so)."""
    accs = [ExactAccumulator(_params(), M) for _ in parts]
    for acc, ids in zip(accs, parts):
        for i in ids:
            _fold(acc, i, 2.0 ** 20 if i in spiked else 1.0)
    reduced = sum(acc.pack() for acc in accs)
    wide = sum(acc.pack_wide() for acc in accs) if accs[0].wide_needed(reduced) else None
    assert (wide is not None) == any(i in spiked for ids in parts for i in ids)
    loss = accs[0].load_mean(reduced, M, wide)
    return accs[0].buffer[:-1].numpy().tobytes(), loss


@st.composite
def partitions(draw):
    M = draw(st.integers(1, 24))
    ids = list(range(100, 100 + M))
    R = draw(st.integers(1, M))
    owner = draw(st.lists(st.integers(0, R - 1), min_size=M, max_size=M))
    parts = [[i for i, o in zip(ids, owner) if o == r] for r in range(R)]
    order = draw(st.permutations(range(R)))
    parts = [draw(st.permutations(parts[r])) for r in order]  # any order of replicas and of folds
    return M, ids, parts


@settings(max_examples=60, deadline=None)
@given(partitions())
def test_any_partition_and_order_commits_the_same_bits(case):
    M, ids, parts = case
    assert _committed(parts, M) == _committed([ids], M)
    # with spikes: some ids go to the wide sums, whoever folds them
    assert _committed(parts, M, frozenset(SPIKED)) == _committed([ids], M, frozenset(SPIKED))


def test_fp32_accumulation_is_order_dependent_where_exact_is_not():
    # The reason for the module: the same ids summed in fp32 in two orders differ in the last bits.
    M = 16
    ids = list(range(M))
    fwd = sum(torch.cat([g.reshape(-1) for g in _grad_of(i)]) for i in ids)
    rev = sum(torch.cat([g.reshape(-1) for g in _grad_of(i)]) for i in reversed(ids))
    assert not torch.equal(fwd, rev)
    assert _committed([ids], M) == _committed([list(reversed(ids))], M)


def test_the_mean_is_close_to_the_float64_mean():
    M = 8
    ids = list(range(M))
    exact, loss = _committed([ids], M)
    got = torch.frombuffer(bytearray(exact), dtype=torch.float32).double()
    want = sum(torch.cat([g.reshape(-1).double() for g in _grad_of(i)]) for i in ids) / M
    shift = fixed_point_shift(12, M)
    # absolute: the fixed point's resolution; relative: the final fp32 rounding
    assert torch.all((got - want).abs() <= 2.0 ** -shift + want.abs() * 2.0 ** -23)
    assert loss == pytest.approx(sum(_loss_of(i) for i in ids) / M, rel=1e-12)


def test_a_spike_goes_to_the_wide_sums_and_beyond_them_is_counted_never_added():
    M = 4
    a, b = ExactAccumulator(_params(), M), ExactAccumulator(_params(), M)
    _fold(a, 0)
    a.spike_next_fold(2.0 ** 20)  # the grad_spike fault's hook: beyond 2^12, inside 2^42
    _fold(a, 1)
    assert a.out_of_range == {} and int(a.pack()[-2]) == 1 and a.wide is not None and b.wide is None
    _fold(b, 2)
    _fold(b, 3)
    reduced = a.pack() + b.pack()
    assert a.wide_needed(reduced) and b.wide_needed(reduced)  # every replica reads the same count
    a.load_mean(reduced, M, a.pack_wide() + b.pack_wide())
    want = sum(torch.cat([g.reshape(-1).double() for g in _grad_of(i, 2.0 ** 20 if i == 1 else 1.0)])
               for i in range(4)) / M
    got = a.buffer[:-1].double()
    assert torch.all((got - want).abs() <= 2.0 ** -a.wide_shift + want.abs() * 2.0 ** -23)
    with pytest.raises(ValueError, match="needs the reduced pack_wide"):
        a.load_mean(reduced, M)
    b.clear()
    b.spike_next_fold(2.0 ** 60)  # beyond the wide range too
    _fold(b, 2)
    _fold(b, 3)  # the spike is spent: 3 is in range
    assert list(b.out_of_range) == [2] and "not below 2^42" in b.out_of_range[2]
    assert int(b.pack()[-1]) == 1 and math.isnan(b.reduced_loss_sum(a.pack() + b.pack()))
    with pytest.raises(ExactRangeError, match="outside the fixed-point range"):
        a.load_mean(a.pack() + b.pack(), M, a.pack_wide() + b.pack_wide())
    b.clear()
    assert b.out_of_range == {} and int(b.pack().abs().sum()) == 0 and int(b.pack_wide().abs().sum()) == 0


def test_non_finite_gradients_and_losses_are_out_of_range():
    q, amax = to_fixed(torch.tensor([1.0, float("nan")]), 40, 12)
    assert q is None
    q, amax = to_fixed(torch.tensor([1.0, float("inf")]), 40, 12)
    assert q is None and amax == math.inf
    acc = ExactAccumulator(_params(), 2)
    acc.fold(5, float("nan"))
    assert "loss" in acc.out_of_range[5]


def test_the_largest_in_range_sum_does_not_wrap():
    # M microbatches each at the top of the range: the int64 sum stays below 2^62.
    for M in (1, 2, 3, 7, 8, 1000, 4096):
        shift = fixed_point_shift(12, M)
        top = torch.full((3,), 2.0 ** 12, dtype=torch.float32).nextafter(torch.tensor(0.0))
        q, _ = to_fixed(top, shift, 12)
        total = q * M
        assert int(total.max()) < 2 ** 62
        assert torch.equal(from_fixed(total, shift, M), top)


def test_shift_refuses_a_range_that_leaves_no_bits():
    with pytest.raises(ValueError, match="shift"):
        fixed_point_shift(60, 8)


def test_the_readmes_exact_mode_figures_are_the_committed_benchmarks():
    import json
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    readme = (root / "docs" / "exact.md").read_text()  # the README's section, moved to docs/
    prec = json.loads((root / "results" / "bench" / "exact_precision.json").read_text())
    m = re.search(r"the loss curve of `--exact` is within ([0-9.e-]+) relative of fp32 mode's", readme)
    assert m and float(m.group(1)) == float(f"{prec['max_rel_diff']:.2g}") and prec["max_rel_diff"] < 1e-4
    assert prec["steps"] == 200 and prec["model"] == "small"
    cost = {r["model"]: r["over_fp32"] for r in
            json.loads((root / "results" / "bench" / "exact_compute.json").read_text())["rows"]}
    m = re.search(r"deterministic kernels alone x([0-9.]+) \(tiny\) and x([0-9.]+) \(small\) on CPU; the\s+"
                  r"whole exact mode x([0-9.]+) and x([0-9.]+)", readme)
    assert m, "README.md lost the exact mode's cost sentence"
    assert [float(x) for x in m.groups()] == [round(cost["tiny"]["deterministic"], 2),
                                              round(cost["small"]["deterministic"], 2),
                                              round(cost["tiny"]["exact"], 2), round(cost["small"]["exact"], 2)]
