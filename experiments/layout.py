"""The layout of one replica: how many ranks it is, and along which dimensions.

Contract:
- `ReplicaLayout(shard, tp, pp)` is the rank grid inside one replica (the failure
  domain): `shard` ranks over which FSDP2 shards the model
  (HSDP), `tp` tensor-parallel and `pp` pipeline-parallel ranks (nanotron's names;
  each defaults to 1). A replica is shard x tp x pp ranks, one GPU per rank, so
  `ranks` (= `gpus`) is the product. Any of them failing takes the replica out.
- Every dimension is an int >= 1; anything else is a ValueError naming the field,
  raised when the layout is built.
- The mapping onto what each side of the suite counts:
    * a real run (`recover train`): `shard`, `tp` and `pp` are TrainConfig.shard,
      .tp and .pp; R replicas are R x ranks worker processes;
    * the simulator: `JobModel.gpus_per_replica` == `ranks` (experiments/sim/model.py),
      and the simulator's costs depend on the replica's size only, not on how it splits.
- `describe()` is the layout in words, as scenarios and figures write it ("TP 8 x PP 4").
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from recover.core.config.fields import doc_field as _f

DIMENSIONS = ("shard", "tp", "pp")
_WORDS = {"shard": "shard", "tp": "TP", "pp": "PP"}


@dataclass(frozen=True)
class ReplicaLayout:
    """The ranks of one replica: shard x tp x pp, one GPU each."""

    shard: int = _f(1, "FSDP2 shard S: ranks over which the model's parameters are sharded (HSDP)")
    tp: int = _f(1, "tensor-parallel ranks TP")
    pp: int = _f(1, "pipeline-parallel stages PP")

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layout {name}: must be an integer >= 1, got {v!r}")

    @property
    def ranks(self) -> int:
        """Ranks in one replica: shard x tp x pp."""
        return self.shard * self.tp * self.pp

    @property
    def gpus(self) -> int:
        """GPUs in one replica: one per rank."""
        return self.ranks

    def non_trivial(self) -> dict[str, int]:
        """The dimensions above 1, by name (empty: a replica of one rank)."""
        return {name: getattr(self, name) for name in DIMENSIONS if getattr(self, name) > 1}

    def describe(self) -> str:
        """In words: 'TP 8 x PP 4', 'shard 2', '1 rank'."""
        parts = [f"{_WORDS[k]} {v}" for k, v in self.non_trivial().items()]
        return " x ".join(parts) if parts else "1 rank"

    def check_size(self, gpus_per_replica: int) -> None:
        """ValueError unless this layout has exactly `gpus_per_replica` ranks."""
        if self.ranks != gpus_per_replica:
            raise ValueError(f"layout {self.describe()} is shard {self.shard} x tp {self.tp} x pp {self.pp} = "
                             f"{self.ranks} ranks, but the replica has {gpus_per_replica} GPUs (one per rank)")

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReplicaLayout":
        """From any dict holding some of shard, tp, pp (a TrainConfig's, a RunSpec's); others default to 1."""
        return cls(**{k: d[k] for k in DIMENSIONS if k in d})
