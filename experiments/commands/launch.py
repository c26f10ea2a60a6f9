"""`recover launch`: run your own training script as a resilient job on this machine.

Contract: starts the coordinator (store + membership) and one process per replica
running the given command, each with RECOVER_REPLICA, RECOVER_STORE_ADDR and
RECOVER_CONTROL_ADDR set so that `recover.core.Replica.from_env(...)` joins the
job. With --shard S, --tp T and --pp P (and --pp-schedule), P x S x T processes per
replica (RECOVER_LOCAL_RANK, RECOVER_RANKS_PER_REPLICA, RECOVER_TP, RECOVER_PP,
RECOVER_PP_SCHEDULE), which join through
`recover.core.parallel.join.ReplicaContext.from_env()` (examples/hsdp_loop.py,
tp_loop.py, pp_loop.py); any of them dying ends the others of its replica. The
workers train a model of their own, so --tp and --pp are not checked against a
--model (TrainConfig.validate(own_model=True)): the loop's own setup checks them. With --replace-after S, a replica whose process dies gets a new one in its
slot S seconds later, which joins at the next commit with the live state. The results contract (config.json, metrics.jsonl, events.jsonl,
summary.json, logs/) is written to --out exactly as for `recover train`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recover.core.config.train_config import ConfigError, TrainConfig
from recover.core.launch.launcher import Launcher, python_module_argv
from recover.core.storage.results import read_jsonl, write_summary
from recover.core.contract import env_names
from recover.core.launch.coordinator_command import MODULE as COORDINATOR, coordinator_args

from . import fail


# the TrainConfig fields a user's job is run with
LAUNCH_FIELDS = ("replicas", "shard", "tp", "pp", "pp_schedule", "microbatches", "steps", "heartbeat_timeout", "collective_timeout", "heartbeat_interval",
                 "fence_after", "max_failed_generations", "startup_timeout", "replace_after", "min_replicas", "max_heal_attempts",
                 "rejoin", "coordinator_timeout", "reconnect_timeout", "coordinator_restarts", "on_nonfinite")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="run your own training script as a resilient job",
        description=__doc__.split("\n")[0] + " Usage: recover launch [flags] -- COMMAND [ARGS...]",
    )
    for name in LAUNCH_FIELDS:
        f = TrainConfig.__dataclass_fields__[name]
        if isinstance(f.default, bool):
            p.add_argument("--" + name.replace("_", "-"), dest=name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=f"{f.metadata['help']} (default: {f.default})")
            continue
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=type(f.default), default=f.default,
                       help=f"{f.metadata['help']} (default: {f.default})")
    p.add_argument("--out", default="runs/launch", help="output directory (default: runs/launch)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the worker command, after --")
    p.set_defaults(func=cmd_launch)


def cmd_launch(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        return fail("COMMAND: missing; give the worker command after --")
    cfg = TrainConfig(system="recover", out=args.out, **{name: getattr(args, name) for name in LAUNCH_FIELDS})
    try:
        cfg.validate(own_model=True)
    except ConfigError as e:
        return fail(str(e))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "events.jsonl", "summary.json"):
        (out / name).unlink(missing_ok=True)
    config_path = out / "config.json"
    config_path.write_text(json.dumps({"train": cfg.to_dict(), "command": cmd}, indent=2))
    t0 = time.time()
    launcher = Launcher(
        out, python_module_argv(COORDINATOR, *coordinator_args(config_path, "recover")),
        # RECOVER_REJOIN: Replica.from_env's default for rejoining after a false death
        lambda r: cmd, cfg.replicas, env={env_names.T0: repr(t0), env_names.REJOIN: "1" if cfg.rejoin else "0",
                                         env_names.COORDINATOR_TIMEOUT: repr(cfg.coordinator_timeout),
                                         env_names.RECONNECT_TIMEOUT: repr(cfg.reconnect_timeout),
                                         # what a replica of many ranks reads (core/parallel/join.py)
                                         env_names.COLLECTIVE_TIMEOUT: repr(cfg.collective_timeout),
                                         env_names.HEARTBEAT_INTERVAL: repr(cfg.heartbeat_interval),
                                         env_names.HEARTBEAT_TIMEOUT: repr(cfg.heartbeat_timeout),
                                         env_names.TP: str(cfg.tp), env_names.PP: str(cfg.pp),
                                         env_names.PP_SCHEDULE: cfg.pp_schedule},
        replace_after=cfg.replace_after if cfg.replace_after >= 0 else None,
        coordinator_restarts=cfg.coordinator_restarts, coordinator_timeout=cfg.coordinator_timeout,
        ranks_per_replica=cfg.ranks_per_replica,
    )
    result = launcher.run()
    ends = [e for e in read_jsonl(out / "events.jsonl") if e.get("kind") == "run_end"]
    reason = ends[-1]["reason"] if ends else result.reason
    summary = write_summary(out, "ok" if result.returncode == 0 else "failed", time.time() - t0,
                            returncode=result.returncode, reason=reason,
                            processes=[e.__dict__ for e in result.exits])
    print(f"{summary['status']}: {summary['steps']}/{cfg.steps} steps committed -> {out} ({reason})")
    return 0 if summary["status"] == "ok" else 1
