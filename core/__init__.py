"""recover.core: the resilient-training core (layers 1-3, trainers, workload).

The public API for your own training loop is `Replica` (see replica.py):

    from recover.core import Replica

It is imported lazily so that light modules (hooks, config) stay torch-free to import.
"""


def __getattr__(name):
    if name in ("Replica", "RunEnded", "GradientDetached"):
        from . import replica

        return getattr(replica, name)
    raise AttributeError(f"module 'recover.core' has no attribute {name!r}")
