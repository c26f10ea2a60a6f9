"""The layout of one replica: how many ranks it is, along which dimensions, and what it needs of a model.

Contract:
- `ReplicaLayout(shard, tp, pp)` is the rank grid inside one replica (the failure
  domain): `shard` ranks over which FSDP2 shards the model
  (HSDP), `tp` tensor-parallel and `pp` pipeline-parallel ranks (nanotron's names;
  each defaults to 1). A replica is shard x tp x pp ranks, one GPU per rank, so
  `ranks` (= `gpus`) is the product. Any of them failing takes the replica out.
- Every dimension is an int >= 1; anything else is a ValueError naming the field,
  raised when the layout is built.
- `check(...)` is the one place where a layout is held against a model and a
  batch: --tp must divide the attention heads and the MLP width, --pp may not
  exceed the layers, the rows of a microbatch (--batch-size) must be at least
  --shard, and the pipeline schedule is one of `PP_SCHEDULES`. It raises the first
  problem as a `ConfigError` naming the flag; TrainConfig.validate (`recover train`)
  and ParallelismArgs.validate (a user's own loop, with torch's model in hand) both
  ask it, so a rule and its words are written once.
- The mapping onto what each side of the project counts:
    * a real run (`recover train`): `shard`, `tp` and `pp` are TrainConfig.shard,
      .tp and .pp (`TrainConfig.layout()`); R replicas are R x ranks worker processes;
    * the simulator: `JobModel.gpus_per_replica` == `ranks` (experiments/sim/model.py),
      and the simulator's costs depend on the replica's size only, not on how it splits.
- `describe()` is the layout in words, as scenarios and figures write it ("TP 8 x PP 4").
Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from recover.core.config.errors import ConfigError
from recover.core.config.fields import doc_field as _f

DIMENSIONS = ("shard", "tp", "pp")
PP_SCHEDULES = ("afab", "1f1b")
"""nanotron's names: all-forward-all-backward (GPipe) and one-forward-one-backward."""
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

    def check(self, pp_schedule: str = "1f1b", *, heads: int | None = None, mlp_width: int | None = None,
              layers: int | None = None, batch_size: int | None = None, model: str = "") -> "ReplicaLayout":
        """Raise a ConfigError for the first thing this layout cannot run; else return self.

        Args:
            pp_schedule: the pipeline schedule's name.
            heads, mlp_width, layers: the model's attention heads, MLP width (4 x n_embd) and
                blocks; a rule whose figure is None is not checked (a user's own model).
            batch_size: sequences per microbatch, split over the `shard` positions.
            model: how the error names the model (e.g. "--model tiny"), or "".
        Returns:
            self.
        """
        named = f" ({model})" if model else ""
        if pp_schedule not in PP_SCHEDULES:
            raise ConfigError("--pp-schedule", f"{pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        if self.tp > 1 and heads is not None and heads % self.tp:
            raise ConfigError("--tp", f"{self.tp} does not divide the model's {heads} attention heads{named}")
        if self.tp > 1 and mlp_width is not None and mlp_width % self.tp:
            raise ConfigError("--tp", f"{self.tp} does not divide the model's MLP width {mlp_width}{named}")
        if self.pp > 1 and layers is not None and self.pp > layers:
            raise ConfigError("--pp", f"{self.pp} stages, but the model has {layers} layers{named}; "
                                      f"each stage needs at least one")
        if batch_size is not None and batch_size < self.shard:
            # the shard positions split each microbatch's rows (the tp ranks of one position share them)
            raise ConfigError("--shard", f"each rank takes rows of a microbatch: --batch-size {batch_size} "
                                         f"is less than --shard {self.shard}")
        return self

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReplicaLayout":
        """From any dict holding some of shard, tp, pp (a TrainConfig's, a RunSpec's); others default to 1."""
        return cls(**{k: d[k] for k in DIMENSIONS if k in d})
