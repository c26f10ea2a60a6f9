"""A torchft replica group of many ranks (fault-tolerant HSDP, as torchft wires it): its store, its FSDP2 grid, its shard state.

Contract:
- A replica group is S x T ranks (`--shard S`, `--tp T`; RECOVER_LOCAL_RANK = the
  rank in the group). Its rank 0 hosts the group's own c10d `TCPStore` (as every torchft
  replica group does: the Manager finds its ManagerServer's address there) and
  publishes the store's port in DIR/baseline/group_stores/replica<r> (written
  whole: a temporary file renamed into place). The other ranks read it there.
  That wait has no clock of its own: its bound is rank 0's liveness, which the
  launcher enforces (a replica's ranks end together: any rank that exits, rank 0
  included, has the others SIGKILLed by PID; core/launch/replica_processes.py).
- `group_context(...)` builds, over that store, the plain process-group grid
  inside the group that torchft's own FSDP test builds (`init_device_mesh` over
  the group's ranks, default group = the replica group, gloo): recover's
  `ParallelContext`, so TP splits and FSDP2 shards the model over the group exactly
  as they do for `--system recover` and `plain` at the same layout (a SUM reduce-scatter:
  gloo has no averaging reduce-scatter, and torchft's ProcessGroupGloo refuses
  reduce-scatter altogether, so the shard dimension is never a torchft group).
  Across groups only torchft's ProcessGroupGloo is used (one per rank position,
  owned by that rank's Manager).
- `shard_state(work)` / `load_shard_state(work, sd)`: a rank's part of the
  group's state for torchft's healing (the Manager's state_dict callbacks): the
  local tensors of its parameter shards and of their AdamW state, and the LR
  schedule's position. Plain tensors only (torchft's HTTP transport sends them
  as they are; a DTensor would carry its process groups with it); a rank heals
  from the rank at its own position in a live group (torchft asks the source
  for the checkpoint of the same group rank), so shards of one position match.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .runlog import baseline_dir

STORE_POLL_S = 0.01  # how often a rank > 0 looks for its rank 0's store port


def _store_file(out: Path, replica: int) -> Path:
    return baseline_dir(out) / "group_stores" / f"replica{replica}"


def group_store(out: Path, replica: int, local_rank: int) -> dist.TCPStore:
    """The replica group's store: hosted by local rank 0 (port published), a client elsewhere."""
    path = _store_file(out, replica)
    if local_rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, path)
        return store
    while not path.exists():  # bounded by rank 0's liveness (see the contract)
        time.sleep(STORE_POLL_S)
    return dist.TCPStore("127.0.0.1", int(path.read_text()), is_master=False, wait_for_workers=False)


def group_context(store: dist.Store, replica: int, local_rank: int, cfg, timeout: float):
    """The group's rank grid (default group + FSDP2 mesh) over `store`: recover's ParallelContext."""
    from recover.core.parallel.args import ParallelismArgs
    from recover.core.parallel.context import ParallelContext

    layout = ParallelismArgs(cfg.replicas, cfg.shard, cfg.tp, cfg.pp, cfg.pp_schedule)
    return ParallelContext(store, replica, local_rank, layout, backend="gloo", timeout=timeout)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_state(work) -> dict:
    """This rank's part of the group's training state, as plain tensors (see the contract)."""
    params = work.acc.params
    with torch.no_grad():
        optim = [{k: (_local(v).detach().clone() if isinstance(v, torch.Tensor) else v)
                  for k, v in work.optimizer.state[p].items()} for p in params]
        return {"weights": [_local(p).detach().clone() for p in params], "optim": optim,
                "schedule": work.stepper.state_dict()}


def load_shard_state(work, sd: dict) -> None:
    """Load `shard_state` of the same position of another group into this rank, in place."""
    params = work.acc.params
    if len(sd["weights"]) != len(params):
        raise ValueError(f"a shard state of {len(sd['weights'])} parameters for a rank of {len(params)}")
    with torch.no_grad():
        for p, t in zip(params, sd["weights"]):
            _local(p).copy_(t)
        for p, st in zip(params, sd["optim"]):
            mine = work.optimizer.state[p]
            for k, v in st.items():
                if not isinstance(v, torch.Tensor):
                    mine[k] = v
                elif isinstance(mine.get(k), torch.Tensor):
                    _local(mine[k]).copy_(v)
                elif isinstance(p, DTensor) and v.shape == _local(p).shape:
                    # a state this rank never made (it had not stepped yet): the param's own layout
                    mine[k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
                else:
                    mine[k] = v.clone()
    work.stepper.load_state_dict(sd["schedule"])
