"""recover.core: the resilient-training core (layers 1-3, trainers, workload), one
sub-package per plane (contract, storage, config, launch, coordinator, worker,
components, parallel, training: the README's Layout says what each holds).

The public API for your own training loop is `Replica` (see worker/replica.py):

    from recover.core import Replica

It is imported lazily so that light modules (hooks, config) stay torch-free to import.
"""


__all__ = ["Replica", "RunEnded", "GradientDetached"]


def __getattr__(name):
    if name in __all__:
        from recover.core.worker import replica

        return getattr(replica, name)
    raise AttributeError(f"module 'recover.core' has no attribute {name!r}")
