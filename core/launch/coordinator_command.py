"""The coordinator's command line, built in one place (torch-free: every launcher imports it cheaply).

Contract: `MODULE` is what `python -m` runs; `coordinator_args(config, mode, ...)` are its
arguments for a first start (`--mode store`: the baselines' bare rendezvous store;
`--mode recover`: recover's membership service too) and `rebuild_args(...)` the ones a
restart adds (core/coordinator/process.py documents each flag). Every launcher (recover
train and launch, the Slurm task, the checkpoint-restart and elastic baselines, the
restarting launcher) builds the command from these, so a flag is added or renamed once.
"""
from __future__ import annotations

from pathlib import Path

MODULE = "recover.core.coordinator.process"


def coordinator_args(config: str | Path, mode: str, *, host: str | None = None, store_port: int | None = None,
                     control_port: int | None = None) -> list[str]:
    """The arguments after `python -m MODULE` for a coordinator of `mode` over `config` (its config.json).

    Args:
        config: the run's config.json.
        mode: "store" or "recover" (the process checks it; a system whose supervisor starts a
            coordinator of its own, torchft's lighthouse, names its own mode here and never runs this).
        host: the address to bind and advertise (the process's default: 127.0.0.1).
        store_port, control_port: the ports (0: the OS picks; the default too).
    Returns:
        The argument list.
    """
    args = ["--config", str(config), "--mode", mode]
    if host is not None:
        args += ["--host", host]
    if store_port is not None:
        args += ["--store-port", str(store_port)]
    if control_port is not None:
        args += ["--control-port", str(control_port)]
    return args


def rebuild_args(host: str, store_port: int, control_port: int, expect: list[int] | None = None) -> list[str]:
    """What a restart adds to the first start's arguments: rebuild on the same ports.

    Args:
        host, store_port, control_port: where the dead coordinator served.
        expect: the replicas whose processes still run (None: every replica).
    Returns:
        The argument list.
    """
    args = ["--rebuild", "--host", host, "--store-port", str(store_port), "--control-port", str(control_port)]
    if expect is not None:
        args += ["--expect", ",".join(map(str, expect))]
    return args
