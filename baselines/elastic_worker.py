"""One TorchElastic worker: the entrypoint each `torchrun` agent runs (`-m recover.baselines.elastic_worker`).

Contract:
- It is started by a real TorchElastic agent (one agent per simulated node, one
  worker per agent) with the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT,
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
from .trainer import Incarnation, train  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "TorchElastic worker", replica=False)  # its node is RECOVER_REPLICA
    _die_with_agent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    # `kill -USR1 <pid>` writes every thread's stack to the node's log (a hung run's tests do)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    node = int(os.environ[env_names.REPLICA])
    cfg, hooks = begin(args.config, node, pin_device=False)
    settings = load_settings(args.config)
    t0 = run_start_time()
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
