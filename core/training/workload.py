"""One replica's training state: the model, its optimizer, and its accumulator + ledger.

Contract:
- `fold(id)` runs forward and backward of microbatch `id` into the local gradient
  accumulator (`accumulator.py`) and records `id` in the ledger; nothing else
  changes the accumulator except `apply` (which consumes it) and `discard`.
- `pack()` returns a fresh communication buffer (never the accumulator itself).
- `apply(reduced, M, step)` divides the summed gradient by M (the iteration's fixed
  microbatch count, whatever failed) and hands it to the shared recipe
  (`recipe.CommittedStep`: committed step `step`'s learning rate, clipping,
  AdamW), then empties the accumulator and ledger. It returns the iteration's
  mean microbatch loss and the learning rate it used.
- With `--dtype bf16` the forward pass (and so the backward's matmuls) runs under
  bf16 autocast; weights, gradients, the accumulator and the reduction stay fp32.
- Every replica built from the same config holds identical weights at step 0.
- With `--exact` the accumulator is core/worker/exact.py's ExactAccumulator (int64 fixed
  point, summed per microbatch) and torch's deterministic algorithms are on: an id's
  gradient and the committed mean are then the same bits on every replica. In a
  replica of many ranks (--shard, --tp, --pp) it is core/parallel/fsdp.py's
  ExactShardedAccumulator (with --pp, its ExactPipelineAccumulator, which the pipeline
  hands each id's gradient as soon as that id's own schedule run is over): the same bits
  on every replica of the same layout.
- In a replica of many ranks (`ctx`, a core.parallel ParallelContext: HSDP), the
  model is sharded with FSDP2 over the replica's ranks, the accumulator is the
  sharded one (core/parallel/fsdp.py), and each rank folds its rows of every
  microbatch, its loss scaled by its share of the rows: the ranks' gradients sum
  to the microbatch's, and `fold` returns this rank's part of its loss.
- With tensor parallelism (`ctx.args.tp` = T > 1) each block is first split over
  the replica's "tp" ranks (core/parallel/tp.py), then FSDP2 shards over "shard"
  when S > 1; the rows of a microbatch are split by shard index only, so the T
  ranks of one shard position fold the same rows (and only tp index 0 counts the
  loss: core/parallel/fsdp.py).
- With pipeline parallelism (`ctx.args.pp` = P > 1) this rank's model is its stage
  of the GPT (core/parallel/pp.py), then TP and FSDP2 as above; microbatches are
  not folded one by one but a list at a time through the pipeline's schedule
  (`forward_backward_many`), which gives every id's loss on every stage (under
  --exact, through one schedule per id, each id's gradient taken before the next).
"""
from __future__ import annotations

import torch

from recover.core.worker.accumulator import GradAccumulator
from recover.core.config.train_config import TrainConfig
from recover.core.components.data import MicrobatchSource, load_tokens, microbatch_seed
from recover.core.worker.fold import PhaseHook
from recover.core.components.model import GPT
from recover.core.worker.recipe import CommittedStep, build_adamw


class Workload:
    """The model replica and its in-iteration state (accumulator + ledger)."""

    def __init__(self, cfg: TrainConfig, device: str = "cpu", ctx=None):
        self.cfg = cfg
        self.ctx = ctx
        self.device = torch.device(device)
        gcfg = cfg.gpt_config()
        tokens = load_tokens(cfg.data, cfg.corpus_bytes)
        if len(tokens) and int(tokens.max()) >= gcfg.vocab_size:
            raise ValueError(
                f"--vocab-size: data has token id {int(tokens.max())} but the vocabulary is {gcfg.vocab_size}"
            )
        self.source = MicrobatchSource(tokens, cfg.batch_size, gcfg.block_size, cfg.seed)
        # Identical seeding on every replica gives identical initial weights.
        torch.manual_seed(cfg.seed)
        self.model = GPT(gcfg).to(self.device)
        self.model.train()
        self.pipeline = None  # pipeline parallelism: core.parallel.pp.Pipeline (P > 1)
        if ctx is None and cfg.exact:  # order-free fixed-point sums (core/worker/exact.py)
            from recover.core.worker.exact import ExactAccumulator, deterministic_kernels
            deterministic_kernels()
            self.acc = ExactAccumulator(self.model.parameters(), cfg.microbatches, cfg.exact_range)
        elif ctx is None:
            self.acc = GradAccumulator(self.model.parameters())
        else:
            from recover.core.parallel.fsdp import ShardedAccumulator, shard_model
            a = ctx.args
            if a.pp > 1:  # this rank's stage only (built from the whole model, so the same weights)
                from recover.core.parallel.pp import GPTStage
                a.validate(gcfg)
                self.model = GPTStage(self.model, ctx.pp_index, a.pp)
            if a.tp > 1:
                from recover.core.parallel.tp import tensor_parallel
                a.validate(gcfg)
                tensor_parallel(self.model, ctx.tp_mesh)
            if a.shard > 1 or (a.tp == 1 and a.pp == 1):
                shard_model(self.model, ctx.shard_mesh)
            # after TP and FSDP2, which replace the parameters (a list taken before would name none)
            duplicates = self.model.duplicates() if a.pp > 1 else []
            if cfg.exact:  # the int64 sums over this rank's shard (its stage's, taken id by id, with --pp)
                from recover.core.parallel.fsdp import ExactPipelineAccumulator, ExactShardedAccumulator
                from recover.core.worker.exact import deterministic_kernels
                deterministic_kernels()
                exact_cls = ExactPipelineAccumulator if a.pp > 1 else ExactShardedAccumulator
                self.acc = exact_cls(self.model, cfg.microbatches, cfg.exact_range, mesh=ctx.mesh,
                                     duplicates=duplicates)
            else:
                self.acc = ShardedAccumulator(self.model, mesh=ctx.mesh, duplicates=duplicates)
            if a.pp > 1:
                from recover.core.parallel.pp import Pipeline
                rows = torch.tensor_split(torch.arange(cfg.batch_size), a.shard)[ctx.shard_index].numel()
                self.pipeline = Pipeline(self.model, ctx, cfg.pp_schedule, cfg.seed, rows=rows,
                                         share=rows / cfg.batch_size, device=self.device,
                                         rebind=self.acc.absorb_detached,
                                         take=self.acc.take if cfg.exact else None)
        self.schedule = cfg.lr_schedule()
        self.optimizer = build_adamw(self.acc.params, self.schedule(0), cfg.weight_decay)
        self.stepper = CommittedStep(self.optimizer, self.acc.params, self.schedule, cfg.grad_clip,
                                     self.acc.grad_norm_clipper)
        self.autocast_dtype = torch.bfloat16 if cfg.dtype == "bf16" else None

    @property
    def ledger(self) -> list[int]:
        return self.acc.ledger

    @property
    def accumulator(self) -> torch.Tensor:
        return self.acc.buffer

    @property
    def tokens_per_microbatch(self) -> int:
        return self.source.tokens_per_microbatch

    def fold(self, mb_id: int, hook: PhaseHook | None = None) -> float:
        """Forward+backward of microbatch `mb_id` into the accumulator and ledger; returns its loss."""
        loss = self.forward_backward(mb_id, hook)
        self.acc.fold(mb_id, loss)
        return loss

    def forward_backward(self, mb_id: int, hook: PhaseHook | None = None) -> float:
        """Forward+backward of microbatch `mb_id` into the gradients, without the ledger entry."""
        k = len(self.acc.ledger)
        x, y = self.source.get(mb_id)
        share = 1.0
        if self.ctx is not None:  # this rank's rows of the microbatch (see the contract)
            from recover.core.parallel.fsdp import microbatch_part
            x, y, share = microbatch_part(x, y, self.ctx.shard_index, self.ctx.args.shard)
        x, y = x.to(self.device), y.to(self.device)
        # Per-microbatch randomness (dropout) is a function of (seed, id) only.
        torch.manual_seed(microbatch_seed(self.cfg.seed, mb_id))
        if hook:
            hook("forward", k)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_dtype is not None):
            _, loss = self.model(x, y)
        if hook:
            hook("backward", k)
        if share != 1.0:
            loss = loss * share
        loss.backward()
        return float(loss.detach())

    def forward_backward_many(self, ids: list[int], at: PhaseHook | None = None) -> list[float]:
        """Pipeline parallelism: forward+backward of the microbatches `ids` through one run of the
        schedule, into the gradients, without ledger entries; returns their losses (this rank's part)."""
        if self.pipeline is None:
            raise RuntimeError("forward_backward_many runs a pipeline (--pp > 1); fold one id at a time")
        xs, ys = [], []
        from recover.core.parallel.fsdp import microbatch_part
        for i in ids:
            x, y = self.source.get(i)
            x, y, _ = microbatch_part(x, y, self.ctx.shard_index, self.ctx.args.shard)
            xs.append(x)
            ys.append(y)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_dtype is not None):
            return self.pipeline.run(list(ids), xs, ys, at)

    def fold_many(self, ids: list[int], at: PhaseHook | None = None) -> list[float]:
        """`forward_backward_many`, then every id into the ledger; returns their losses."""
        losses = self.forward_backward_many(ids, at)
        for i, loss in zip(ids, losses):
            self.acc.fold(i, loss)
        return losses

    def pack(self) -> torch.Tensor:
        """A fresh communication buffer: [gradient sum ..., loss sum]."""
        return self.acc.pack()

    def wide_after(self, reduced: torch.Tensor) -> torch.Tensor | None:
        """With --exact: the wide sums to all-reduce next when the reduced buffer says a replica
        folded a spike (core/worker/exact.py); None when there is nothing more to reduce."""
        return self.acc.pack_wide() if self.acc.wide_needed(reduced) else None

    def apply(self, reduced: torch.Tensor, microbatches: int, step: int,
              wide: torch.Tensor | None = None) -> tuple[float, float]:
        """Commit step `step` with reduced/M; empty accumulator and ledger; return (mean loss, lr).
        `wide`: with --exact, the reduced wide sums when the step had a spike (core/worker/exact.py)."""
        mean_loss = self.acc.load_mean(reduced, microbatches, wide)
        lr = self.stepper(step)
        self.acc.clear()
        return mean_loss, lr

    def discard(self) -> None:
        """Empty the accumulator and ledger (a new iteration starts)."""
        self.acc.clear()

    def shard_digests(self) -> list[str] | None:
        """A replica of many ranks: every rank's `weights_digest()` of its local shards, by local rank
        (a collective of the replica's ranks: all call it); None for a replica of one rank."""
        if self.ctx is None:
            return None
        out: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, self.acc.weights_digest())
        return out

    def state_checksum(self) -> float:
        """A cheap fingerprint of the weights, for tests comparing replicas."""
        with torch.no_grad():
            if self.ctx is None:
                return float(sum(p.double().sum() for p in self.model.parameters()))
            # the replica's ranks each hold a shard: sum the local parts over the replica (all ranks call
            # this), each part once (a part whole on several tp ranks is counted by one of them)
            local = torch.tensor([float(sum(view.double().sum() for view, counted in
                                            zip(self.acc.local_weights(), self.acc.counted) if counted))],
                                 dtype=torch.float64)
            torch.distributed.all_reduce(local)
            return float(local)
