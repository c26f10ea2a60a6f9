"""Exact, order-independent gradient accumulation (`--exact`): the committed sum depends
only on the SET of microbatch ids, never on which replica folded which id, in what
order, or how many replicas reduced.

Contract:
- Each microbatch's fp32 gradient is converted, alone, to int64 fixed point:
  q = round(g * 2^shift), one shift for the whole run (`fixed_point_shift`). Its
  loss likewise, with `LOSS_SHIFT`. The int64 sums are exact (integer addition is
  associative), the all-reduce sums int64 exactly (gloo's SUM), and the sum is
  converted back once: g_mean = fp32(float64(sum) * (2^-shift / M)). Every step of
  that is a function of the per-id values alone, so two runs that fold the same ids
  on the same weights commit the same bits, whatever their partition of the ids.
- The range: an element's magnitude must be below 2^range (`--exact-range`, E) in
  every microbatch. With h = M.bit_length() (so M < 2^h), shift = 62 - h - E makes
  each microbatch's |q| <= 2^(62-h) and any sum of at most M of them below 2^62:
  the int64 sum cannot overflow once every microbatch is in range. So the check is
  per microbatch (`to_fixed` says whether the microbatch fits).
- A spike: a microbatch that does not fit goes, whole, into a second set of int64
  sums, the wide ones, whose range is 2^30 times larger (and resolution 2^30
  coarser: `WIDE_EXTRA_BITS`). The reduced count of such microbatches tells every
  replica to all-reduce the wide sums too (one more collective, only in a step that
  has one), and the mean adds both: still a function of the set of ids alone, so a
  spike neither stops the run nor breaks bit-identity; it costs that microbatch
  30 bits of resolution. Where a choice of scale would need a vote and a redo of the
  step, the wide sums need neither: every replica reads the same count.
- A microbatch beyond the wide range too (an element >= 2^(E+30)), or not finite, or
  with a loss beyond the loss range, is never added: it is counted ("bad") and
  reported (`out_of_range`), and the step must not commit (recover's vote names it
  as a non-finite loss; `load_mean` raises `ExactRangeError`). Nothing out of range
  is ever silently wrapped.
- Precision: the rounding error is at most 2^-(shift+1) per element per microbatch,
  absolute: 2^(E+h-63). With E = 12 and M = 8 that is 2^-47 (7e-15); fp32's own
  rounding of a sum is 6e-8 relative, so exact mode is the more precise of the two
  for every element above ~1e-7. Elements far below that keep fewer than fp32's 24
  bits; their contribution to an update is that small too.
- What an accumulator keeps (`ExactAccumulator`): the parameters' `.grad` still view
  a flat fp32 buffer (the backward writes there, as in fp32 mode), which must hold
  one microbatch only: `fold` converts it into the int64 sums and zeroes it. The
  int64 buffer is [gradient sums..., loss sum, wide count, bad count]; `pack` copies
  it; after its all-reduce, `wide_needed(reduced)` says whether `pack_wide()` must be
  all-reduced too; `load_mean(reduced, M, wide)` turns them into the mean gradient in
  `.grad` and returns the mean loss (loss sum / M, the same float64 division the
  coordinator does for recover's metrics, so plain and recover report the same bits).
  `out_of_range` maps each id of the ledger that was bad to why.
- Memory: 20 bytes per parameter for gradients instead of fp32 mode's 4: the fp32
  `.grad` buffer, the int64 sums, and one int64 microbatch (which `load_mean` reuses as
  its float64 scratch); `fold` scales the fp32 buffer in place before zeroing it. The
  wide sums add 8 more, allocated only once a spike happens.

Why one fixed shift for the whole run rather than a per-tensor scale derived from
shared state (the last committed gradient, say): int64 has 63 bits, fp32 24, so one
shift leaves ~20 bits of headroom above fp32's precision for the largest element
allowed; a fixed shift is a function of the config alone, so nothing about it has to
be checkpointed, healed into a newcomer or rebuilt by a restarted coordinator; and it
makes the conversion one elementwise pass over the flat buffer. A per-tensor scale
would buy precision for tensors whose gradients are far below 2^E, at the price of
carrying that state through every path that moves state. Why per microbatch and not
per replica: a replica's partial sum in fp32 already depends on its order; only
values converted before any floating-point addition are order-free.
Deterministic forward/backward (the same bits for an id on any replica) is the
trainer's part: `deterministic_kernels()` below, called by the Workload in exact mode.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from recover.core.worker.accumulator import GradAccumulator

LOSS_SHIFT = 32  # a loss's fixed point: 2^-32 resolution, far below an fp32 loss's own ulp at >= 2^-9
DEFAULT_RANGE = 12  # --exact-range: elements of a microbatch's gradient below 2^12 = 4096 in magnitude
WIDE_EXTRA_BITS = 30  # the wide sums' range: 2^30 times the normal one (2^42 by default), 2^30 coarser


class ExactRangeError(RuntimeError):
    """A microbatch's gradient or loss was outside the fixed-point range: the step must not commit."""


def headroom_bits(microbatches: int) -> int:
    """h with M < 2^h: the bits a sum of M in-range terms may add."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    return int(microbatches).bit_length()


def fixed_point_shift(range_bits: int, microbatches: int) -> int:
    """The shift s (q = g * 2^s) for elements below 2^range_bits and M microbatches."""
    s = 62 - headroom_bits(microbatches) - range_bits
    if not 1 <= s <= 100:
        raise ValueError(f"--exact-range {range_bits} with M={microbatches} leaves a shift of {s}; "
                         f"it must be in [1, 100]")
    return s


def _max_abs(g: torch.Tensor) -> float:
    """max |g| in one pass (no |g| tensor); NaN when g holds a NaN; 0 when g is empty."""
    if not g.numel():
        return 0.0
    lo, hi = torch.aminmax(g)  # NaN propagates into both
    return max(-float(lo), float(hi)) if not (lo.isnan() or hi.isnan()) else math.nan


def to_fixed(g: torch.Tensor, shift: int, range_bits: int, scratch: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, float]:
    """(round(g * 2^shift) as int64, max |g|), or (None, max |g|) when an element is >= 2^range_bits
    or not finite. g * 2^shift is exact in fp32 (a power of two, far from fp32's limits once
    |g| < 2^range_bits); round-half-even of it is exact; the cast to int64 then is too.
    `scratch` (fp32) and `out` (int64), shaped as g, spare the allocations."""
    amax = _max_abs(g)
    if not amax < 2.0 ** range_bits:  # also catches NaN and inf (comparisons with NaN are False)
        return None, amax
    t = torch.mul(g, 2.0 ** shift, out=scratch) if scratch is not None else g * (2.0 ** shift)
    t.round_()
    return (out.copy_(t) if out is not None else t.to(torch.int64)), amax


def from_fixed(total: torch.Tensor, shift: int, microbatches: int, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of M microbatches from their int64 sum: fp32(float64(total) * (2^-shift / M)).
    `out` (fp32) and `scratch` (float64), shaped as total, spare the allocations."""
    t = scratch.copy_(total) if scratch is not None else total.to(torch.float64)
    t.mul_(2.0 ** -shift / microbatches)
    return out.copy_(t) if out is not None else t.to(torch.float32)


def loss_to_fixed(loss: float, microbatches: int) -> int | None:
    """A microbatch's loss in fixed point (None: not finite, or beyond the loss range)."""
    if not math.isfinite(loss) or abs(loss) >= 2.0 ** (62 - headroom_bits(microbatches) - LOSS_SHIFT):
        return None
    return round(loss * 2.0 ** LOSS_SHIFT)  # python float: exact scaling, round-half-even


def loss_from_fixed(total: int) -> float:
    """A loss sum from its fixed point (float64)."""
    return float(total) * 2.0 ** -LOSS_SHIFT


def deterministic_kernels() -> None:
    """Ask torch for deterministic kernels: an id's gradient must be the same bits on every
    replica (same hardware and thread count, which the config fixes with --threads). On CPU
    most kernels already are; on CUDA this also needs CUBLAS_WORKSPACE_CONFIG, set here
    before any cuBLAS handle exists when it is not set already."""
    import os
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.benchmark = False


BAND_FULL, BAND_WIDE, BAND_BAD = 0, 1, 2  # where a microbatch's gradient goes: the full sums, the wide ones, none


def band_of(amax: float, loss_fits: bool, range_bits: int) -> int:
    """The band of a microbatch (or of one rank's part of it) from its max |element| and whether its
    loss fits: BAND_FULL below 2^range_bits, BAND_WIDE below 2^(range_bits + WIDE_EXTRA_BITS), else
    BAND_BAD (also a NaN or inf, whose comparisons are False). A replica of many ranks takes the
    largest band of its ranks' parts (ExactSums._agree), so all its ranks sum the microbatch alike."""
    if not loss_fits or not amax < 2.0 ** (range_bits + WIDE_EXTRA_BITS):
        return BAND_BAD
    return BAND_FULL if amax < 2.0 ** range_bits else BAND_WIDE


class ExactSums:
    """The int64 fixed-point sums over an accumulator's flat fp32 `buffer` = [gradient (or this rank's
    shard of it)..., loss slot] (see the module's contract): a mixin placed before the accumulator it
    makes exact (GradAccumulator here, core/parallel/fsdp.py's ShardedAccumulator for a replica of
    many ranks), which provides `buffer`, `ledger` and `clear()`.

    The two points where a rank of a replica of many ranks differs, as hooks: `_agree(band)`
    returns the band the whole replica takes for a microbatch (here: this rank's own; a rank of
    many: the largest over the replica's ranks, one small collective), so every rank sums it in
    the same band and every rank's wide and bad counts are the same; `_loss_total(part)` turns
    this rank's int64 loss part of a reduced buffer into the replica's loss sum (here: itself;
    a rank of many: their exact int64 sum over the replica's ranks). `counts_loss` (False: this
    rank's loss parts are counted by another rank) leaves the loss slot of the sums at 0."""

    counts_loss = True

    def _init_exact(self, microbatches: int, range_bits: int) -> None:
        self.microbatches = microbatches
        self.range_bits = range_bits
        self.shift = fixed_point_shift(range_bits, microbatches)
        self.wide_range_bits = range_bits + WIDE_EXTRA_BITS
        self.wide_shift = self.shift - WIDE_EXTRA_BITS
        n = self.buffer.numel() - 1
        self.n = n
        # [gradient sums..., loss sum, wide count, bad count]
        self.sums = torch.zeros(n + 3, dtype=torch.int64, device=self.buffer.device)
        self.wide: torch.Tensor | None = None  # the wide sums, allocated at the first wide microbatch
        # one microbatch in fixed point; load_mean reuses its 8 bytes per element as float64
        self._q = torch.empty(n, dtype=torch.int64, device=self.buffer.device)
        self.out_of_range: dict[int, str] = {}  # ids of the ledger that did not fit, and why
        self._spike: float | None = None

    def _agree(self, band: int) -> int:
        return band

    def _loss_total(self, part: int) -> int:
        return part

    def spike_next_fold(self, factor: float) -> None:
        """A test hook (the grad_spike fault kind): the next folded microbatch's gradient is
        multiplied by `factor` before it is converted, as a sudden gradient spike would be."""
        self._spike = float(factor)

    def fold(self, mb_id: int, loss: float) -> None:
        """Convert the microbatch gradient in `.grad` (this id's alone) into the int64 sums."""
        self.ledger.append(mb_id)  # raises, with nothing changed, on an id folded twice
        self._sum_microbatch(mb_id, loss)

    def _sum_microbatch(self, mb_id: int, loss: float) -> None:
        """`fold` without the ledger entry: the gradient in `.grad` into the sums (in the replica's
        band), its loss into the loss slot, `.grad` zeroed."""
        g = self.buffer[:-1]
        if self._spike is not None:
            g.mul_(self._spike)
            self._spike = None
        lq = loss_to_fixed(float(loss), self.microbatches)
        amax = _max_abs(g)
        own = band_of(amax, lq is not None, self.range_bits)
        band = self._agree(own)
        # g is zeroed below whatever happens: it is its own scratch (no extra fp32 copy of the model);
        # the band says which shift; this rank's part fits it (the replica's band is at least its own)
        if band == BAND_FULL:
            self.sums[:-3].add_(self._q.copy_(torch.mul(g, 2.0 ** self.shift, out=g).round_()))
        elif band == BAND_WIDE:  # a spike: the coarser sums take it
            if self.wide is None:
                self.wide = torch.zeros(self.n, dtype=torch.int64, device=self.buffer.device)
            self.wide.add_(self._q.copy_(torch.mul(g, 2.0 ** self.wide_shift, out=g).round_()))
            self.sums[-2] += 1
        if band == BAND_BAD:
            self.out_of_range[mb_id] = (
                "another rank's part of it is outside the fixed-point range" if own != BAND_BAD else
                f"loss {loss!r} is outside the fixed-point loss range" if lq is None else
                f"max |gradient element| {amax:g} is not below 2^{self.wide_range_bits} = "
                f"{2.0 ** self.wide_range_bits:g} (--exact-range {self.range_bits} + {WIDE_EXTRA_BITS})")
            self.sums[-1] += 1
        elif self.counts_loss:
            self.sums[-3] += lq
        g.zero_()

    @property
    def loss_sum(self) -> float:
        """The folded loss sum (a rank of many: its part of it)."""
        return loss_from_fixed(int(self.sums[-3]))

    def pack(self) -> torch.Tensor:
        """A fresh communication buffer: int64 [gradient sums..., loss sum, wide count, bad count]."""
        return self.sums.clone()

    def wide_needed(self, reduced: torch.Tensor) -> bool:
        """Whether a reduced `pack()` says some replica folded a wide microbatch: then every
        replica all-reduces `pack_wide()` too (they all read the same count)."""
        return int(reduced[-2]) > 0

    def pack_wide(self) -> torch.Tensor:
        """A fresh buffer of the wide sums (zeros on a replica that folded no wide microbatch)."""
        if self.wide is None:
            return torch.zeros(self.n, dtype=torch.int64, device=self.buffer.device)
        return self.wide.clone()

    def reduced_loss_sum(self, reduced: torch.Tensor) -> float:
        """The loss sum a reduced buffer holds (a rank of many: its part; NaN when a microbatch of
        the step was out of range, read alike by every rank of a replica)."""
        if int(reduced[-1]):
            return math.nan
        return loss_from_fixed(int(reduced[-3]))

    def load_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> float:
        """Set every .grad to the mean gradient; return the mean loss (loss sum / M, float64).
        `wide`: the reduced `pack_wide()`, required when `wide_needed(reduced)`."""
        self._load_gradients(reduced, microbatches, wide)
        return loss_from_fixed(self._loss_total(int(reduced[-3]))) / microbatches

    def load_shard_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> None:
        """`load_mean` without the loss (a rank of many: without its collective; the resilient replica's
        combine carried the loss already): the int64 sums converted into the mean gradient (an fp32
        accumulator's own would read the int64 buffer as fp32)."""
        self._load_gradients(reduced, microbatches, wide)

    def _load_gradients(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None) -> None:
        """`load_mean`'s gradients: every .grad set to the mean; the loss left alone."""
        if int(reduced[-1]):
            raise ExactRangeError(
                f"{int(reduced[-1])} microbatch(es) of the step had a gradient or loss outside the fixed-point "
                f"range (elements must be below 2^{self.wide_range_bits}); the step is not committed")
        if not 1 <= microbatches <= self.microbatches:  # the shift bounds a sum of at most M
            raise ValueError(f"the shift was derived for at most M={self.microbatches} microbatches, "
                             f"not {microbatches}")
        if self.wide_needed(reduced) and wide is None:
            raise ValueError("the step has wide microbatches: load_mean needs the reduced pack_wide()")
        t = self._q.view(torch.float64).copy_(reduced[:-3])
        t.mul_(2.0 ** -self.shift / microbatches)
        if self.wide_needed(reduced):
            t.add_(wide.to(torch.float64).mul_(2.0 ** -self.wide_shift / microbatches))
        self.buffer[:-1].copy_(t)

    def clear(self) -> None:
        super().clear()
        self.sums.zero_()
        if self.wide is not None:
            self.wide.zero_()
        self.out_of_range.clear()


class ExactAccumulator(ExactSums, GradAccumulator):
    """A GradAccumulator whose sums are int64 fixed point (see the module's contract)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], microbatches: int, range_bits: int = DEFAULT_RANGE):
        """Pass it to `Replica` (or `Replica.from_env`) in place of the parameters for a bit-identical run.

        Args:
            params: the parameters to train (fp32); their `.grad` then views the accumulator.
            microbatches: M, the run's microbatches per step (the fixed point's headroom).
            range_bits: the normal range: gradient elements below 2^range_bits (--exact-range).

        Raises:
            ValueError: no trainable parameter, or `range_bits` with M leaves no valid fixed-point shift.
            TypeError: a parameter is not fp32.
        """
        GradAccumulator.__init__(self, params)
        self._init_exact(microbatches, range_bits)
