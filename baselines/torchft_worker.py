"""One rank of a torchft replica group: `python -m recover.baselines.torchft_worker --config C --replica R`.

Contract:
- The real torchft: a `torchft.Manager` per rank of a replica group (its rank 0
  hosts the group's own TCPStore and ManagerServer), quorums from the lighthouse
  at http://$RECOVER_CONTROL_ADDR, the cross-replica all-reduce through
  `Manager.allreduce` on torchft's reconfigurable `ProcessGroupGloo`, and the
  commit vote `Manager.should_commit`. The manager is driven directly (the
  pattern that survived a peer's death with torchft 0.2.0 and the nightly alike)
  because our workload already owns its gradients in one flat accumulator.
- A group of many ranks (`--shard S` and/or `--tp T` > 1: N = S x T ranks;
  RECOVER_LOCAL_RANK is the rank in the group) is fault-tolerant HSDP as torchft
  wires it: the Manager of each rank has `rank` = its rank in the group and
  `world_size` = N, FSDP2 shards the model (after TP splits it, with T > 1) over
  plain gloo groups of the group's ranks (`torchft_group.py`: the group's store
  and grid), and each rank all-reduces its own shard of the gradient sum
  (its flat accumulator) with the ranks at its position in the other groups,
  once per step, over its Manager's ProcessGroupGloo. (torchft's FSDP wiring
  issues that same all-reduce from an FSDP all-reduce hook inside every
  backward; with several microbatches per step, once per step on the
  accumulated shard is the same sum in fewer calls.) `should_commit` is one vote
  of the group (torchft's ManagerServer ANDs its ranks'), so the ranks of a group
  commit or discard a step together. A group heals from a live group position by
  position (`torchft_group.shard_state`). Any rank dying takes its whole group
  out (the launcher ends a replica's ranks together); the other groups go on.
- Its semantics as they are: replica r always folds its own share of iteration
  t's ids (`assign_quotas(iteration_ids(t, M), range(R))[r]`). A replica that is
  gone takes its share with it: the global batch shrinks while replicas are
  missing, and the gradient is the mean over the microbatches the participants
  folded. A step whose all-reduce or vote fails is discarded by every survivor and
  retried, with the same ids, by the next quorum.
- The all-reduce also carries, beside gradient and loss sums, a one-hot of the
  participating replica ids and their microbatch count, so every survivor knows
  exactly which microbatches were committed (metrics.jsonl's microbatch_id_ranges and
  members). Every participant that committed the step writes (in a group of many
  ranks, its rank 0; every position carries the same counts) its metrics line and,
  when the group changed or attempts were discarded, its events.jsonl record, with
  `append_step_once`: the first lands, the others find it there. (One writer was
  not enough: a replica SIGKILLed after its share of the all-reduce but before its
  write leaves the survivors with a step committed and no line for it.)
- Deadlines: an all-reduce (torchft's ProcessGroupGloo), a quorum's pieces and the
  connections take `--torchft-timeout`; the commit vote (`should_commit`) twice that, so
  a rank whose all-reduce used up its deadline still meets its group's vote.
- Replicas start together: each rank waits (up to --torchft-timeout x 3) until every
  rank's manager is up before its first quorum, as a scheduler gang-starts a
  job, so the first quorum has everyone and the short join timeout is for faults.
- metrics.jsonl's generation is torchft's quorum id (the manager keeps it private;
  read with getattr so a rename in torchft degrades to -1, not a crash).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

_STARTED = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from recover.core.components.data import iteration_ids  # noqa: E402
from recover.core.worker.fold import fold_quota  # noqa: E402
from recover.core.contract.policy import assign_quotas  # noqa: E402
from recover.core.storage.results import metric_record  # noqa: E402
from recover.core.launch.startup import begin, run_start_time, worker_args  # noqa: E402
from recover.core.training.workload import Workload  # noqa: E402
from recover.core.contract import env_names  # noqa: E402

from .runlog import append_step_once, baseline_dir, first_detection, record_detection  # noqa: E402
from .settings import load_settings  # noqa: E402
from .torchft_group import group_context, group_store, load_shard_state, shard_state  # noqa: E402


def _gang_start(out: Path, replica: int, rank: int, ranks: int, timeout: float) -> None:
    """Announce this rank is up; wait until all `ranks` of the job are (or `timeout` passes)."""
    d = baseline_dir(out) / "ready"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"replica{replica}_rank{rank}").touch()
    end = time.monotonic() + timeout
    while len(list(d.iterdir())) < ranks and time.monotonic() < end:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "torchft replica group")
    local = int(os.environ.get(env_names.LOCAL_RANK, "0"))  # rank in the replica group
    cfg, hooks = begin(args.config, args.replica, pin_device=False, rank=local)  # this baseline runs on CPU (below)
    settings = load_settings(args.config)
    t0 = run_start_time()
    out = Path(cfg.out)
    R, M, replica, S = cfg.replicas, cfg.microbatches, args.replica, cfg.ranks_per_replica

    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=settings.torchft_timeout)
    # The replica group's own store (torchft keys it per group: manager address, replica id); with
    # S ranks, rank 0 hosts it and the group's FSDP2 grid is built over it too.
    store = group_store(out, replica, local)
    ctx = None if S == 1 else group_context(store, replica, local, cfg, cfg.collective_timeout)
    work = Workload(cfg, "cpu", ctx=ctx)
    hooks.attach_weights(work.acc)  # a bitflip fault corrupts these (and nothing here notices)

    def state_dict() -> dict:
        if ctx is not None:  # this rank's shards (torchft heals position by position)
            return shard_state(work)
        return {"model": work.model.state_dict(), "optim": work.optimizer.state_dict(),
                "schedule": work.stepper.state_dict()}

    def load_state_dict(sd: dict) -> None:  # a replica that fell behind heals from a peer
        if ctx is not None:
            load_shard_state(work, sd)
            return
        work.model.load_state_dict(sd["model"])
        work.optimizer.load_state_dict(sd["optim"])
        work.stepper.load_state_dict(sd["schedule"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=settings.torchft_min_replicas, use_async_quorum=False, timeout=timeout,
        quorum_timeout=3 * timeout, connect_timeout=timeout, rank=local, world_size=S,
        store_addr="127.0.0.1", store_port=store.port, replica_id=f"replica{replica}", hostname="127.0.0.1",
        lighthouse_addr=f"http://{os.environ[env_names.CONTROL_ADDR]}",
        heartbeat_interval=timedelta(milliseconds=settings.torchft_heartbeat_ms),
        init_sync=False,  # every replica seeds identically: equal weights at step 0
    )
    # After the manager is up (heartbeating): the lighthouse then waits for every
    # heartbeating replica to join the first quorum, however slowly each started.
    _gang_start(out, replica, local, R * S, 3 * settings.torchft_timeout)
    full = assign_quotas(iteration_ids(0, M), list(range(R)))  # sizes only; ids per step below
    share = {r: len(q) for r, q in full.items()}
    metrics, events = out / "metrics.jsonl", out / "events.jsonl"
    prev_members: list[int] = list(range(R))
    discarded: list[dict] = []  # failed attempts of the current step
    try:
        while True:
            manager.start_quorum()
            step = manager.current_step()
            if step >= cfg.steps:
                break
            quota = assign_quotas(iteration_ids(step, M), list(range(R)))[replica]
            fold_quota(step, quota, work.fold, hooks)  # (S > 1: this rank's rows of each microbatch)
            who = torch.zeros(R + 1)
            who[replica], who[R] = 1.0, float(len(quota))
            buf = torch.cat([work.pack(), who])
            handle = manager.allreduce(buf, reduce_op=dist.ReduceOp.SUM)
            try:
                hooks.at(step, "allreduce")
            except Exception as e:  # an injected broken link: the collective failed
                manager.report_error(e)
            handle.wait()
            hooks.at(step, "vote")
            hooks.at(step, "commit")
            # The vote's deadline is twice the collective's: a group's vote waits for each of its
            # ranks, and a rank whose all-reduce waited out its whole deadline (gloo waits for a
            # peer that left the ring rather than failing at once) must still meet it. With the
            # two equal, a group whose other rank was already voting timed out just as the slow
            # rank arrived, the exception reached this loop and a survivor exited (seen at
            # 3 x S2 with the lighthouse at 250 ms: no group was left).
            if not manager.should_commit(timeout=2 * timeout):
                # torchft discards the whole step; the next quorum retries it.
                record_detection(out, step, replica, t0, f"step {step} not committed: {manager.errored()}")
                discarded.append({"participants": manager.num_participants()})
                work.discard()
                continue
            hooks.at(step, "optimizer_step")
            counts = buf[-(R + 1):]
            members = [r for r in range(R) if counts[r] > 0.5]
            n_mb = int(round(float(counts[R])))
            loss, lr = work.apply(buf[: -(R + 1)], n_mb, step)
            ids = sorted(i for r in members for i in assign_quotas(iteration_ids(step, M), list(range(R)))[r])
            rec = metric_record(step, loss, n_mb * work.tokens_per_microbatch, ids, getattr(manager, "_quorum_id", -1),
                                members, t0, participants=manager.num_participants(), lr=lr)
            if local != 0:  # the group's rank 0 writes for it (every position holds the same counts)
                prev_members, discarded = members, []
                continue
            if members != prev_members or discarded:
                seen = first_detection(out, step)
                detected_at = seen["at"] if seen else None
                # before the metrics line: a reader that sees step s's line finds its event
                append_step_once(events, {k: v for k, v in {
                    "kind": "quorum_change" if members != prev_members else "step_retried",
                    "step": step, "previous_members": prev_members, "members": members,
                    "lost_replicas": sorted(set(prev_members) - set(members)),
                    "detected_at": detected_at, "resumed_at": rec["wall_time"],
                    "restart_seconds": None if detected_at is None else rec["wall_time"] - detected_at,
                    "discarded_attempts": len(discarded),
                    # each discarded attempt lost the shares its group had folded
                    "work_lost_microbatches": len(discarded) * sum(share[r] for r in prev_members),
                    "global_batch": n_mb,
                }.items() if v is not None})  # unknown values are left out, not null
            append_step_once(metrics, rec)
            prev_members, discarded = members, []
    except BaseException as e:
        record_detection(out, -1, replica, t0, f"{type(e).__name__}: {e}")
        raise
    if replica == prev_members[0]:
        checksum = work.state_checksum()  # (a collective of the group's ranks when it has many)
        if local == 0:
            final = {"step": cfg.steps, "weights_checksum": checksum, "replica": replica}
            (baseline_dir(out) / "final.json").write_text(json.dumps(final))
    if ctx is not None:
        # rank 0's shutdown ends the group's ManagerServer: not while another rank is still reading
        # its answer to the last quorum (bounded by the group's liveness: its ranks end together)
        dist.barrier()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
