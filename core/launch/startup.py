"""Worker start-up: what every worker process reads from its command line and its environment.

Contract:
- A worker is started as `python -m MODULE --config DIR/config.json --replica r`
  (`worker_args`; TorchElastic's workers take no --replica: their node is
  RECOVER_REPLICA) with the launcher's environment:
    RECOVER_STORE_ADDR    host:port of the coordinator's c10d store (`connect_store`)
    RECOVER_CONTROL_ADDR  host:port of the coordinator's control service (or a lighthouse)
    RECOVER_T0            the run's start on the time.time() clock (`run_start_time`)
    RECOVER_JOIN_TOKEN    the run's random join token (`new_join_token`): a worker's
                          hello must carry it, or the coordinator refuses the connection
  `env_addr(VAR)` parses a host:port variable; a missing one raises KeyError.
- Every store client of a worker is `keyed_store(TCPStore client, token)`: a PrefixStore of the
  run's namespace (an HMAC of the join token, `core.contract.store_guard.store_namespace`), so each key it
  names lies in the namespace that the coordinator's store guard lets through. `connect_store`
  returns one, keyed by RECOVER_JOIN_TOKEN.
- `begin(config, replica)` is every trainer's first lines: load the resolved
  config, size torch's thread pool, pin this replica's GPU, build its hooks.
- Importing this module imports no torch (the injector and the fault drill use it
  in processes that never import torch): the functions that need torch import it.
"""
from __future__ import annotations
from recover.core.contract import env_names

import argparse
import os
import secrets
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

    from recover.core.config.train_config import TrainConfig
    from recover.core.launch.hooks import WorkerHooks


def add_worker_flags(ap: argparse.ArgumentParser, replica: bool = True) -> argparse.ArgumentParser:
    """Add a worker's flags: --config (DIR/config.json) and, unless `replica` is False, --replica."""
    ap.add_argument("--config", required=True)
    if replica:
        ap.add_argument("--replica", type=int, required=True)
    return ap


def worker_args(argv: list[str] | None, description: str, replica: bool = True) -> argparse.Namespace:
    """Parse a worker's command line (`add_worker_flags`)."""
    return add_worker_flags(argparse.ArgumentParser(description=description), replica).parse_args(argv)


JOIN_TOKEN_ENV = env_names.JOIN_TOKEN


def new_join_token() -> str:
    """A fresh random join token for one run (128 bits, hex)."""
    return secrets.token_hex(16)


def env_addr(var: str) -> tuple[str, int]:
    """(host, port) from the environment variable `var`, set as host:port by the launcher."""
    host, port = os.environ[var].rsplit(":", 1)
    return host, int(port)


def keyed_store(store: "dist.Store", token: str) -> "dist.PrefixStore":
    """`store` seen through the run's namespace (derived from the join token `token`): the one place
    every worker's store client is keyed, so the coordinator's store guard forwards its requests."""
    import torch.distributed as dist

    from recover.core.contract.store_guard import store_namespace

    keyed = dist.PrefixStore(store_namespace(token), store)
    # Name a key of the namespace at once: the coordinator's store guard closes a client that
    # has named none within its deadline (core/contract/store_guard.py), whenever this one first needs a key.
    keyed.check(["connected"])
    return keyed


def connect_store(timeout: float = 60.0, token: str | None = None) -> "dist.PrefixStore":
    """A client of the coordinator's store, from RECOVER_STORE_ADDR=host:port, keyed by the run's join
    token (`token`, else RECOVER_JOIN_TOKEN)."""
    import torch.distributed as dist

    host, port = env_addr(env_names.STORE_ADDR)
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    return keyed_store(client, os.environ.get(JOIN_TOKEN_ENV, "") if token is None else token)


def run_start_time() -> float:
    """The run's start on the time.time() clock: RECOVER_T0 as the launcher sets it (else now)."""
    return float(os.environ.get(env_names.T0, time.time()))


def begin(config_path: str, replica: int, pin_device: bool = True, rank: int = 0) -> tuple["TrainConfig", "WorkerHooks"]:
    """Load DIR/config.json, set torch's threads, pin replica's GPU (`pin_device`), build the hooks of
    its rank `rank` (0 for a replica of one process)."""
    import torch

    from recover.core.config.train_config import TrainConfig
    from recover.core.launch.hooks import load_hooks

    cfg = TrainConfig.load(config_path)
    torch.set_num_threads(cfg.threads)
    hooks = load_hooks(cfg.hooks, cfg, replica, rank)
    if pin_device and cfg.resolved_device() == "cuda":
        torch.cuda.set_device(replica % torch.cuda.device_count())
    return cfg, hooks
