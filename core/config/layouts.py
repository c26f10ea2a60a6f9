"""Which training system runs which replica layout: the one table, and its one-line refusal.

Contract:
- `SYSTEM_LAYOUTS[system]` names the dimensions of a replica's rank grid ("shard":
  FSDP2 over S ranks, "tp": tensor parallel T, "pp": pipeline stages P) that the
  system runs above 1. A system not in the table runs one rank per replica.
- `refusal(system, replicas, shard, tp, pp)` is None when the system runs that
  layout, else the `ConfigError` to raise: flag "--system", and one line naming the
  system, the layout and who runs it ("elastic runs replicas split by S and TP only;
  3 x PP2 needs recover or plain").
- Everything that takes a system and a layout asks this table: TrainConfig.validate
  (`recover train`, `recover launch`), experiments.systems (`System.layout`,
  `check_layout`: the grids of `recover experiment` and `recover bench recovery`),
  so a system learns a layout by one edit here.
Pure: no torch, no processes.
"""
from __future__ import annotations

from recover.core.config.errors import ConfigError

LAYOUT_DIMENSIONS = ("shard", "tp", "pp")
_SHORT = {"shard": "S", "tp": "TP", "pp": "PP"}

SYSTEM_LAYOUTS: dict[str, tuple[str, ...]] = {
    # recover's replicas of many ranks are core/parallel/'s grid; plain, its failure-free
    # reference, builds the same grid from the same blocks (core/training/plain.py).
    "recover": LAYOUT_DIMENSIONS,
    "plain": LAYOUT_DIMENSIONS,
    # torchft's fault-tolerant HSDP: a Manager per rank, FSDP2 (and TP, as torchft's own FSDP
    # test splits a group) over each replica group (baselines/torchft_group.py); no PP.
    "torchft": ("shard", "tp"),
    # checkpoint-restart: the same grid inside each replica (baselines/ckpt_worker.py), sharded DCP
    # checkpoints, the whole job restarted on a fault; no PP.
    "ckpt-restart": ("shard", "tp"),
    # elastic: torchrun agents, a node per replica, its S x T ranks the agent's workers
    # (baselines/elastic_worker.py); no PP.
    "elastic": ("shard", "tp"),
}


def runs(system: str, shard: int = 1, tp: int = 1, pp: int = 1) -> bool:
    """Whether `system` runs replicas of shard x tp x pp ranks."""
    able = SYSTEM_LAYOUTS.get(system, ())
    return all(dim in able for dim, v in zip(LAYOUT_DIMENSIONS, (shard, tp, pp)) if v > 1)


def layout_words(replicas: int, shard: int = 1, tp: int = 1, pp: int = 1) -> str:
    """The job's layout, compactly: '3 x S2', '2 x TP2 x PP2', '4 x 1 rank'."""
    parts = [f"{_SHORT[d]}{v}" for d, v in zip(LAYOUT_DIMENSIONS, (shard, tp, pp)) if v > 1]
    return f"{replicas} x " + (" x ".join(parts) if parts else "1 rank")


def refusal(system: str, replicas: int, shard: int = 1, tp: int = 1, pp: int = 1) -> ConfigError | None:
    """None if `system` runs `replicas` x (shard, tp, pp); else the ConfigError saying so in one line."""
    if runs(system, shard, tp, pp):
        return None
    dims = (shard, tp, pp)
    own = SYSTEM_LAYOUTS.get(system, ())
    what = ("runs one rank per replica" if not own else
            f"runs replicas split by {' and '.join(_SHORT[d] for d in own)} only")
    able = [s for s in SYSTEM_LAYOUTS if runs(s, *dims)]
    who = (f"needs {', '.join(able[:-1])} or {able[-1]}" if len(able) > 1 else
           f"needs {able[0]}" if able else "is run by no system yet")
    return ConfigError("--system", f"{system} {what}; {layout_words(replicas, *dims)} {who}")
