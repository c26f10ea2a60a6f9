"""recover.core: the resilient-training core (layers 1-3, trainers, workload), one
sub-package per plane (contract, storage, config, launch, coordinator, worker,
components, parallel, training: the README's Layout says what each holds).

The public API for your own training loop (docs/own-loop.md; every name below is
importable as `from recover.core import X`):

- `Replica`: one replica's handle on the job: `from_env`, `quota()`, `fold()`, `commit()`, `close()`
- `RunEnded`: raised when the run ends for this replica (its `code` is the exit code)
- `GradientDetached`: raised when a `.grad` no longer views the replica's accumulator
- `ReplicaContext`: one rank's place in a replica of many ranks: `from_env`, `mesh`, `part`, `join`
- `shard_model`: FSDP2 over the replica's ranks, with SUM reductions
- `ShardedAccumulator`: this rank's shard of the replica's gradient sum (FSDP2, TP, PP)
- `ExactAccumulator`: bit-identical (`--exact`) sums for a one-rank replica
- `ExactShardedAccumulator`: the same for a replica of many ranks
- `ExactPipelineAccumulator`: the same for a replica split into pipeline stages
- `deterministic_kernels`: ask torch for deterministic kernels (call it before an exact run)

Each is imported lazily, on first access, so that light modules (hooks, config) stay
torch-free to import: `import recover.core` imports no torch.
"""
from importlib import import_module as _import_module

# name -> the module that defines it (imported on first access, see the docstring)
_PUBLIC = {
    "Replica": "recover.core.worker.replica",
    "RunEnded": "recover.core.worker.replica",
    "GradientDetached": "recover.core.worker.replica",
    "ReplicaContext": "recover.core.parallel.join",
    "shard_model": "recover.core.parallel.fsdp",
    "ShardedAccumulator": "recover.core.parallel.fsdp",
    "ExactAccumulator": "recover.core.worker.exact",
    "ExactShardedAccumulator": "recover.core.parallel.fsdp",
    "ExactPipelineAccumulator": "recover.core.parallel.fsdp",
    "deterministic_kernels": "recover.core.worker.exact",
}

__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(_import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'recover.core' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
