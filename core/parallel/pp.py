"""Pipeline parallelism inside a replica: the GPT's blocks cut into P stages, one per "pp" rank.

Contract:
- `GPTStage(model, stage, stages)` is stage `stage` of a core.components.model.GPT built
  identically on every rank (the same seed): the first stage holds the token and
  position embeddings, every stage a contiguous run of blocks (`stage_blocks`: the
  first n_layer % P stages one block more), the last stage the final layer norm
  and the output head. It keeps `cfg` and `blocks`, so tensor parallelism
  (core/parallel/tp.py) and FSDP2 (core/parallel/fsdp.py) apply to it as to the
  whole model.
- The tied token embedding and output head sit on the first and the last stage.
  The last stage holds the head as its own parameter, a copy of the embedding at
  construction; after every schedule run the two stages add up the gradient that
  run gave each copy (the run's increments only, over the ParallelContext's
  `tie_group`), so both hold the gradient of the tied weight, step identically and
  stay equal: the trajectory is the tied model's. The last stage's copy is counted
  nowhere (`duplicates()`: the gradient norm and the weights checksum see the
  tied weight once, on the first stage).
- Checkpoints name a stage's state by the whole model's names (`global_name`): the
  stage's i-th block is the model's block `stage_blocks(...)[stage][i]` ("blocks.2" on
  the stage holding layers 2-3, not its own "blocks.0"), so the stages' shards never
  share a key in one DCP checkpoint. The embeddings, final norm and head keep their
  names. The last stage's copy of the tied weight is "head.weight": the unsplit GPT's
  state dict holds the tied weight under both "tok_emb.weight" and "head.weight", so
  the first stage's copy and the last's land on the keys a one-stage model writes. Its
  AdamW state is "head.weight"'s too; a one-stage model's optimizer lists the tied weight
  once, as "tok_emb.weight", so a checkpoint without "head.weight"'s state gives the last
  stage "tok_emb.weight"'s (`optimizer_fallback`): the two copies step identically, so
  their states are equal.
- `Pipeline.run(ids, xs, ys, at)` runs torch's own pipelining schedule
  (`ScheduleGPipe` for "afab", `Schedule1F1B` for "1f1b") once over the
  microbatches `ids`, in that order, over the replica's "pp" group: stage 0 gets the
  inputs, the last stage the targets, the microbatch i of the schedule is exactly
  the id ids[i] (the inputs are the ids' batches concatenated, which the schedule
  cuts back into len(ids) equal chunks; a "1f1b" run over fewer ids than stages
  runs as "afab", which is then the same order). The gradients it leaves are added into
  `.grad` (the accumulator's views) and are the plain *sum* over the ids of each
  microbatch's gradient: `scale_grads=False`. torch's default divides by the
  schedule's microbatch count, i.e. by this replica's quota; here the committed
  gradient is (1/M) x the sum over the iteration's M ids, M global, divided once
  at commit (`load_mean`). nanotron's engine likewise averages over the replica's
  own microbatches, and then over replicas: a mean of per-replica means. With
  uneven quotas (R not dividing M, or a survivor that redid a dead replica's ids)
  that weights each microbatch by 1 / (R x its replica's quota), so a replica
  with fewer ids counts its ids more: biased. Summing and dividing by M weights
  every id 1/M whatever replica folded it.
- It returns every id's loss (this rank's part of it: its rows' mean loss times
  their share) on every stage: the last stage computes them and broadcasts them
  over the pp group, so the leader (stage 0) records and reports real losses
  (non-finite ones included); only the last stage adds them to the loss sum
  (ShardedAccumulator.counts_loss).
- The schedule is one unit: it runs the ids it is given, all of them, or the
  replica dies in it (any rank of the replica dying takes the replica out, and
  nothing inside a replica times out). A coordinator's abort is never seen inside
  it; the loop hands it only ids already out of `quota()`.
- `at(phase, k)` is called on every stage at the start of its forward of the k-th
  microbatch ("between_microbatches" first, for every k: core/worker/fold.py drops the
  step's first, as its one-by-one loop never calls it; then "forward"), and
  "backward" when this stage's backward of microbatch k starts (a hook on its
  output's gradient): the fault hooks of core/launch/hooks.py, per stage.
- Randomness: before its forward of microbatch ids[k] every stage reseeds from
  (seed, ids[k]), so a redone microbatch draws the same dropout masks. Stage s > 0
  draws from the reseeded stream rather than where stage s-1 left it, so with
  dropout > 0 a PP run matches a one-rank replica in distribution, not bit for bit.
- FSDP2 stages (S > 1): torch's stage setup, at the first step of every schedule,
  reshards each FSDP module and sets its parameters' `.grad` to None
  (`_post_metadata_inference_cleanup`), which cuts them from the accumulator's
  views; FSDP2 then gives the run's reduce-scattered sum a fresh `.grad`. So
  `Pipeline(..., rebind=acc.absorb_detached)` calls `rebind()` after every run,
  before the tied weights are summed: each fresh `.grad` is added into its view and
  `.grad` points at the view again (earlier runs of the step stay in the views).
  Without it the committed gradient would be empty.
- `--exact` (`take`, given: core/parallel/fsdp.py's ExactPipelineAccumulator.take): the
  int64 sums need each id's gradient alone, and one schedule over many ids leaves in
  `.grad` only their fp32 sum (whose bits depend on which ids this replica ran: quotas
  change after a failure), FSDP2 inside it reduce-scattering once, after the last
  backward. So `run` runs each id through a schedule of its own, in order, and after
  each (its rebind and tied-weight sum done: both stages then hold the same fp32
  gradient of the tied weight for that id) calls `take(id, loss)` on every stage,
  which converts and zeroes `.grad`. The hooks see the same k as in one schedule. The
  cost: the stages no longer overlap (a run of n ids takes about n x P stage-steps
  instead of 1F1B's n + P - 1), one stage setup, one loss broadcast and one tied-weight
  all-reduce per id instead of per run, and the one-int64 band agreement per id.
- Shapes are given to torch (each stage's input and output for one microbatch),
  so its stages skip the runtime shape inference, which would run a forward and
  backward of the stage's module outside any microbatch.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from recover.core.components.data import microbatch_seed

SCHEDULES = {"afab": ScheduleGPipe, "1f1b": Schedule1F1B}
"""nanotron's schedule names -> torch's schedules."""


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous runs, the first n_layer % P stages one block more."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"--pp {stages}: a model of {n_layer} layers has room for 1..{n_layer} stages")
    base, extra = divmod(n_layer, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class GPTStage(nn.Module):
    """One pipeline stage of a core.components.model.GPT (see the module docstring)."""

    def __init__(self, model: nn.Module, stage: int, stages: int):
        super().__init__()
        self.cfg = model.cfg
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.blocks = nn.ModuleList(model.blocks[i] for i in stage_blocks(self.cfg.n_layer, stages)[stage])
        if self.first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        if self.last:
            self.ln_f = model.ln_f
            self.head = model.head
            if not self.first:  # untie: this stage's own copy of the embedding (see the contract)
                with torch.random.fork_rng(), torch.no_grad():  # (its init draws nothing from the seeded stream)
                    self.head = nn.Linear(self.cfg.n_embd, self.cfg.vocab_size, bias=False)
                    self.head.weight.copy_(model.tok_emb.weight)
        self.before_forward: Callable[[int, torch.Tensor], None] | None = None  # set per run by Pipeline
        self.calls = 0

    @property
    def tied(self) -> nn.Parameter | None:
        """This stage's copy of the tied embedding/head weight (None on a middle stage or with P = 1)."""
        if self.stages == 1:
            return None
        return self.tok_emb.weight if self.first else (self.head.weight if self.last else None)

    def global_name(self, name: str) -> str:
        """The whole model's name of this stage's parameter or buffer `name` (see the contract)."""
        head, _, rest = name.partition(".")
        if head != "blocks":
            return name
        index, _, tail = rest.partition(".")
        first = stage_blocks(self.cfg.n_layer, self.stages)[self.stage].start
        return f"blocks.{first + int(index)}" + (f".{tail}" if tail else "")

    def optimizer_fallback(self, name: str) -> str | None:
        """Where a checkpoint without AdamW state for the global `name` (+ ".<field>") holds it:
        the last stage's copy of the tied weight takes the embedding's (see the contract)."""
        if self.last and not self.first and name.startswith("head.weight."):
            return "tok_emb.weight." + name[len("head.weight."):]
        return None

    def duplicates(self) -> list[nn.Parameter]:
        """Parameters that another stage counts (the last stage's copy of the tied weight)."""
        return [self.head.weight] if self.last and not self.first else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.calls
        self.calls += 1
        if self.before_forward is not None:
            self.before_forward(k, x)
        if self.first:
            T = x.shape[1]
            pos = torch.arange(T, device=x.device)
            x = F.dropout(self.tok_emb(x) + self.pos_emb(pos), self.cfg.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


class Pipeline:
    """Runs one schedule over a list of microbatch ids, on one stage of a replica (see the contract)."""

    def __init__(self, stage: GPTStage, ctx, schedule: str = "1f1b", seed: int = 0,
                 rows: int = 1, share: float = 1.0, device: torch.device | str = "cpu",
                 rebind: Callable[[], None] | None = None, take: Callable[[int, float], None] | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"--pp-schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
        self.module = stage
        self.rebind = rebind
        self.take = take  # --exact: each id through a schedule of its own, then take(id, loss) (see the contract)
        self.schedule_cls = SCHEDULES[schedule]
        self.group = ctx.pp_mesh.get_group()
        self.last_rank = dist.get_global_rank(self.group, stage.stages - 1)  # in the replica's group
        self.tie_group = ctx.tie_group
        self.seed = seed
        self.share = share
        self.device = torch.device(device)
        cfg = stage.cfg
        # one microbatch's shapes at this rank (its rows), so torch need not infer them
        T, C, V = cfg.block_size, cfg.n_embd, cfg.vocab_size
        act = torch.empty(rows, T, C, device=self.device, requires_grad=True)  # (received: needs its gradient)
        self.input_example = torch.zeros(rows, T, dtype=torch.long, device=self.device) if stage.first else act
        self.output_example = torch.empty(rows, T, V, device=self.device) if stage.last else act

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # the mean over this rank's rows times their share: the parts sum to the microbatch's mean loss
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return loss * self.share if self.share != 1.0 else loss

    def run(self, ids: list[int], xs: list[torch.Tensor], ys: list[torch.Tensor],
            at: Callable[[str, int], None] | None = None) -> list[float]:
        """Forward and backward of the microbatches `ids` (inputs xs, targets ys) through the schedule
        (with `take`: through one schedule per id, each taken right after its run)."""
        if self.take is None:
            return self._run(ids, xs, ys, at)
        losses: list[float] = []
        for i, (mb, x, y) in enumerate(zip(ids, xs, ys)):
            # the hooks count the ids of the whole call, as one schedule's would
            shifted = None if at is None else (lambda phase, k, i=i: at(phase, i + k))
            [loss] = self._run([mb], [x], [y], shifted)
            self.take(mb, loss)
            losses.append(loss)
        return losses

    def _run(self, ids: list[int], xs: list[torch.Tensor], ys: list[torch.Tensor],
             at: Callable[[str, int], None] | None) -> list[float]:
        """One run of the schedule over `ids`: `run` without `take`."""
        n = len(ids)
        if n == 0:
            return []
        stage = self.module

        def before_forward(k: int, x: torch.Tensor) -> None:
            torch.manual_seed(microbatch_seed(self.seed, ids[k]))
            if at is not None:
                at("between_microbatches", k)  # (the caller's k may start past 0: it drops its own k = 0)
                at("forward", k)

        def after_forward(k: int, out: torch.Tensor) -> None:
            if at is not None and out.requires_grad:
                out.register_hook(lambda g, k=k: (at("backward", k), None)[1])

        stage.before_forward = before_forward
        stage.calls = 0
        handle = stage.register_forward_hook(lambda m, args, out: after_forward(m.calls - 1, out))
        tied = stage.tied
        before = None if tied is None or tied.grad is None else tied.grad.detach().clone()
        try:
            pipe = PipelineStage(stage, stage.stage, stage.stages, self.device,
                                 input_args=(self.input_example,), output_args=(self.output_example,),
                                 group=self.group)
            # 1F1B over fewer microbatches than stages is all of its warm-up: every forward, then every
            # backward, i.e. GPipe's order; torch refuses it there, so such a run (a small redo quota) is GPipe.
            cls = ScheduleGPipe if n < stage.stages else self.schedule_cls
            # scale_grads=False: the plain sum over the ids. torch's default (and nanotron) divide by this
            # replica's n; averaging those per-replica means is biased once quotas are uneven (an id of a
            # replica with fewer ids weighs more). Commit divides the sum by the global M instead.
            schedule = cls(pipe, n, loss_fn=self._loss, scale_grads=False)
            losses: list[torch.Tensor] = []
            if stage.first:
                schedule.step(torch.cat(xs).to(self.device))
            elif stage.last:
                schedule.step(target=torch.cat(ys).to(self.device), losses=losses)
            else:
                schedule.step()
        finally:
            handle.remove()
            stage.before_forward = None
        if self.rebind is not None:
            self.rebind()
        out = torch.zeros(n, dtype=torch.float64)
        if stage.last:
            out.copy_(torch.stack([l.detach().double() for l in losses]))
        dist.broadcast(out, self.last_rank, group=self.group)
        if tied is not None:
            self._sum_tied(tied, before)
        return [float(v) for v in out]

    def _sum_tied(self, tied: nn.Parameter, before: torch.Tensor | None) -> None:
        """Add this run's gradient increments of the two copies of the tied weight (see the contract)."""
        grad = tied.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        base = None if before is None else (before.to_local() if hasattr(before, "to_local") else before)
        delta = local.detach().clone() if base is None else local.detach() - base
        dist.all_reduce(delta, group=self.tie_group)
        with torch.no_grad():
            if base is None:
                local.copy_(delta)
            else:
                local.copy_(base + delta)

