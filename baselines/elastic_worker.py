"""One TorchElastic worker: the entrypoint each `torchrun` agent runs (`-m recover.baselines.elastic_worker`).

Contract:
- It is started by a real TorchElastic agent (one agent per simulated node, one
  worker per rank of the node's replica) with the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT,
  and RECOVER_REPLICA naming its node (stable across re-formations: fault plans
  and the work log name nodes, while ranks are reassigned by each rendezvous).
- Each start is one incarnation of `trainer.train`: resume from the last complete
  DCP checkpoint with the group the rendezvous formed. A smaller group either
  keeps the global batch M (--elastic-batch keep-global: more accumulation per
  rank) or keeps each rank's microbatches (keep-per-replica: the global batch
  shrinks to what that many of the original replicas did).
- Rank 0 numbers the incarnations (DIR/baseline/elastic.json), and dates the fault
  it recovered from by the earliest detection a survivor of the previous
  incarnation recorded (its collective failing, or its agent stopping it).
- It dies with its agent (PR_SET_PDEATHSIG): losing an agent is losing a node.
- A replica of many ranks (`--shard S`, `--tp T`): a node's agent starts S x T
  workers (`--nproc-per-node`, torchrun's LOCAL_RANK the rank in the replica,
  GROUP_RANK the node's place in this rendezvous). They meet on the round's own
  store (MASTER_ADDR:MASTER_PORT, hosted by global rank 0, as env:// would), build
  recover's `ParallelContext` inside the node (the replica's default group and mesh)
  and their position's `Communicator` across the nodes, and run `trainer.train` over
  that grid (`ReplicaGrid`: sharded DCP checkpoints). The nodes' ids and the
  incarnation go through that store; its waits are bounded by its timeout
  (--collective-timeout) and by the agents, which stop every worker of a failed round.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

_STARTED = time.time()

import torch.distributed as dist  # noqa: E402

from recover.core.launch.startup import begin, run_start_time, worker_args  # noqa: E402
from recover.core.contract import env_names

from .runlog import baseline_dir, first_detection  # noqa: E402
from .settings import load_settings  # noqa: E402
from .trainer import Incarnation, ReplicaGrid, train  # noqa: E402


def _die_with_agent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _on_sigterm(signum, frame) -> None:
    # The agent stops its workers with SIGTERM when the group must re-form; as an
    # exception it reaches the trainer, which records when this worker saw it.
    raise SystemExit(f"stopped by the TorchElastic agent (signal {signum})")


def _next_incarnation(out: Path, members: list[int]) -> tuple[int, dict]:
    """Rank 0: this incarnation's number, and what it knows of the fault before it."""
    path = baseline_dir(out) / "elastic.json"
    prev = json.loads(path.read_text()) if path.exists() else {"generation": -1, "members": members}
    generation = prev["generation"] + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"generation": generation, "members": members}))
    notice: dict = {}
    if generation > 0:
        seen = first_detection(out, generation - 1)
        notice = {
            "fault": seen["how"] if seen else None, "detected_at": seen["at"] if seen else None,
            "failed_replicas": sorted(set(prev["members"]) - set(members)),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
    return generation, notice


def _grid_main(cfg, settings, hooks, node: int, t0: float) -> int:
    """A worker of a node of many ranks (see the contract)."""
    from recover.core.parallel.args import ParallelismArgs
    from recover.core.parallel.context import ParallelContext
    from recover.core.worker.comm import Communicator

    local, group_rank = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=cfg.collective_timeout)

    def open_store() -> dist.Store:
        return dist.PrefixStore("recover/", dist.TCPStore(host, port, is_master=False, timeout=timeout))

    # global rank 0 hosts the round's store, as env:// rendezvous would
    master = dist.TCPStore(host, port, is_master=int(os.environ["RANK"]) == 0, timeout=timeout,
                           wait_for_workers=False)
    store = dist.PrefixStore("recover/", master)
    layout = ParallelismArgs(cfg.replicas, cfg.shard, cfg.tp, cfg.pp, cfg.pp_schedule)
    ctx = ParallelContext(store, node, local, layout, backend="gloo", timeout=cfg.collective_timeout)
    # collective over the node's ranks (the default group now), with its own timeout as below
    ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
    if local == 0:
        store.set(f"nodes/{group_rank}", str(node))
    members = [int(store.get(f"nodes/{g}")) for g in range(nodes)]
    if group_rank == 0 and local == 0:
        generation, notice = _next_incarnation(Path(cfg.out), members)
        store.set("incarnation", json.dumps([generation, notice]))
    else:
        generation, notice = json.loads(store.get("incarnation"))
    cross = Communicator.build(open_store, 0, group_rank, nodes, cfg.resolved_backend(), cfg.collective_timeout,
                               namespace=f"pos{local}/")
    inc = Incarnation(generation, group_rank, nodes, node, members, t0, _STARTED - t0)
    return train(cfg, settings, inc, hooks, ckpt_group, keep_global=settings.elastic_batch == "keep-global",
                 fault_notice=lambda: notice, grid=ReplicaGrid(ctx, cross, store, cfg.collective_timeout))


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "TorchElastic worker", replica=False)  # its node is RECOVER_REPLICA
    _die_with_agent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    # `kill -USR1 <pid>` writes every thread's stack to the node's log (a hung run's tests do)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    node = int(os.environ[env_names.REPLICA])
    cfg, hooks = begin(args.config, node, pin_device=False, rank=int(os.environ.get("LOCAL_RANK", "0")))
    settings = load_settings(args.config)
    t0 = run_start_time()
    if cfg.ranks_per_replica > 1:
        return _grid_main(cfg, settings, hooks, node, t0)
    # TorchElastic's contract with its workers is the env:// rendezvous of the
    # process-global default group (what every torchrun user does); the group
    # lives exactly as long as this process, which the agent replaces on re-forming.
    backend = "cpu:gloo,cuda:nccl" if cfg.resolved_backend() == "nccl" else cfg.resolved_backend()
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.collective_timeout))
    # new_group does not inherit the default group's timeout: without its own, DCP's
    # collectives would wait out gloo's 30 minutes for a peer that died mid-save
    ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    members: list = [None] * world
    dist.all_gather_object(members, node, group=ckpt_group)
    box = [_next_incarnation(Path(cfg.out), members) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=ckpt_group)
    generation, notice = box[0]
    inc = Incarnation(generation, rank, world, node, members, t0, _STARTED - t0)
    return train(cfg, settings, inc, hooks, ckpt_group,
                 keep_global=settings.elastic_batch == "keep-global", fault_notice=lambda: notice)


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - the agent only needs the exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
