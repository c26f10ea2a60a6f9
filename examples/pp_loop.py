"""Your own loop with pipeline parallelism inside each replica, made resilient by recover.

Run it with 3 replicas of 2 pipeline stages each (6 processes) under the ReCoVer coordinator:

    .venv/bin/recover launch --replicas 3 --pp 2 --pp-schedule 1f1b --microbatches 6 --steps 20 \
        --out runs/pp_loop -- .venv/bin/python examples/pp_loop.py

Every rank runs this same file and keeps one stage: a contiguous run of the model's
layers. The replica's quota of global microbatch ids is the pipeline's microbatches:
the loop takes them all (`list(replica.quota())`, the same ids on every stage), runs
them through one schedule of torch's own `torch.distributed.pipelining` over the
replica's "pp" group, then folds each id with its loss (the last stage computes the
losses and broadcasts them, so the leader, stage 0, reports real ones). Kill any one
process (runs/pp_loop/pids.json lists each replica's ranks): its whole replica goes,
the other replicas redo its microbatches through the same schedule, and the losses
stay those of a run without the kill.
"""
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from recover.core import ReplicaContext, ShardedAccumulator

ROWS = 32  # rows of one microbatch

ctx = ReplicaContext.from_env()  # RECOVER_PP, RECOVER_PP_SCHEDULE (from `recover launch --pp`)
stage, stages = ctx.parallel.pp_index, ctx.parallel.args.pp
torch.manual_seed(0)  # every rank builds the same whole model, then keeps its stage's layers
layers = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh()),
          torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()), torch.nn.Linear(64, 1)]
if ctx.parallel.args.shard > 1:  # each shard rank would take other rows, and nothing here sums them
    raise SystemExit("this example keeps whole stages: run it with --shard 1 (FSDP2 stages: shard_model each "
                     "stage and call acc.absorb_detached() after every schedule run, as core/parallel/pp.py does)")
if not 1 <= stages <= len(layers):
    raise SystemExit(f"--pp {stages}: this model has {len(layers)} layers, room for 1..{len(layers)} stages")
per, extra = divmod(len(layers), stages)  # contiguous runs, the first len % P stages one layer more
start = stage * per + min(stage, extra)
model = torch.nn.Sequential(*layers[start: start + per + (stage < extra)])
acc = ShardedAccumulator(model, mesh=ctx.mesh)  # .grad views this stage's part of the replica's gradient sum
optimizer = torch.optim.AdamW(acc.params, lr=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))  # 5-step warm-up
replica = ctx.join(acc, optimizer, lr_schedule=scheduler, grad_clip=1.0)  # clips over all stages' gradient

group = ctx.parallel.pp_mesh.get_group()  # this rank's stages
last = dist.get_global_rank(group, stages - 1)  # the last stage, in the replica's group
# one microbatch's shapes at this stage, given so that torch need not run the stage to infer them
activation = torch.empty(ROWS, 64, requires_grad=True)  # sent and received between stages, with its gradient
input_example = torch.empty(ROWS, 16) if stage == 0 else activation
output_example = torch.empty(ROWS, 1) if stage == stages - 1 else activation


def batch(mb_id: int):
    """Microbatch `mb_id`'s data: a function of its global id only."""
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(ROWS, 16, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def run(ids: list[int]) -> list[float]:
    """Forward and backward of microbatches `ids` through one schedule; each id's loss, on every stage."""
    pipe = PipelineStage(model, stage, stages, "cpu", input_args=(input_example,),
                         output_args=(output_example,), group=group)
    # 1F1B over fewer microbatches than stages is GPipe's order, and torch refuses it: run GPipe there.
    cls = Schedule1F1B if ctx.parallel.args.pp_schedule == "1f1b" and len(ids) >= stages else ScheduleGPipe
    # scale_grads=False: the stages add the plain sum over the ids, which commit divides by the global M.
    # torch's default divides by this replica's count: a mean of per-replica means is biased when
    # quotas are uneven (a survivor redoing a dead replica's ids).
    schedule = cls(pipe, len(ids), loss_fn=torch.nn.functional.mse_loss, scale_grads=False)
    xs, ys = zip(*(batch(mb) for mb in ids))
    losses: list[torch.Tensor] = []
    if stage == 0:
        schedule.step(torch.cat(xs))
    elif stage == stages - 1:
        schedule.step(target=torch.cat(ys), losses=losses)
    else:
        schedule.step()
    out = torch.zeros(len(ids), dtype=torch.float64)
    if stage == stages - 1:
        out.copy_(torch.stack([loss.detach().double() for loss in losses]))
    dist.broadcast(out, last, group=group)
    return out.tolist()


while not replica.done:
    ids = list(replica.quota())  # the same ids on every stage (an abort may stop it early: run those)
    if ids:
        for mb, loss in zip(ids, run(ids)):
            replica.fold(mb, loss)  # only the last stage adds the loss to the replica's sum
    replica.commit()  # per-stage all-reduce across replicas, the leader's vote, the optimizer step
replica.close()
