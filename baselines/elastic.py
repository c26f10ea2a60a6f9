"""Elastic restart with the real TorchElastic: one `torchrun` agent per simulated node.

Contract:
- `supervise` starts the rendezvous store as its own process (the project's store
  coordinator: `TCPStore(is_master=True, multi_tenant=True)`), then one
  `python -m torch.distributed.run` agent per node with the c10d rendezvous
  backend, --nnodes MIN:R (MIN = --elastic-min-nodes), one worker per rank of
  the node's replica (`elastic_worker.py`), and --rdzv-conf is_host=false, so losing any agent never
  takes the store down (measured: an agent hosting the store takes the job with
  it). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives the workers a store of their
  own per round (measured: without it, restarted workers time out in gloo's
  connectFullMesh, pytorch issue 135712).
- A replica of many ranks (`--shard S`, `--tp T`) is a node of S x T workers
  (`--nproc-per-node S x T`); a worker's crash is TorchElastic's worker failure (every
  worker of every node restarted), a lost agent a lost node (its workers die with it).
- TorchElastic's semantics, unchanged: a worker's crash makes its agent restart
  the workers of every node (up to --max-restarts times); an agent's loss (a node)
  makes the others re-form the group with the nodes left, once the rendezvous'
  last call (--rdzv-last-call-timeout) has passed. Either way every worker starts
  again and resumes from the last complete DCP checkpoint. A fault plan's
  replica_loss is a lost node: its agent is killed too (`LostNodes`).
- The rendezvous timeouts are set short so that re-forming takes seconds, not the
  ~42 s measured with torch's defaults (last call 30 s); what was set is recorded
  in config.json ("baseline") and in DIR/baseline/torchrun.json (the agents' argv).
- The job lasts while any agent does (`UntilWorkersExit`); it succeeds if the
  last group finished every step. Too few nodes left (fewer than MIN) ends the
  run when the rendezvous times out (--rdzv-join-timeout), with a non-zero exit.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Sequence

from recover.core.config.train_config import TrainConfig
from recover.core.launch.launcher import Launcher, LauncherHooks, python_module_argv
from recover.core.contract import env_names
from recover.core.launch.coordinator_command import MODULE as COORDINATOR, coordinator_args

from .runlog import baseline_dir
from .settings import BaselineConfig
from .supervise import SupervisedResult, UntilWorkersExit


def torchrun_argv(cfg: TrainConfig, settings: BaselineConfig, config_path: Path, run_id: str) -> list[str]:
    """The agent's command line, less --rdzv-endpoint (known once the store is up)."""
    conf = ",".join([
        "is_host=false",
        f"last_call_timeout={settings.rdzv_last_call_timeout}",
        f"join_timeout={settings.rdzv_join_timeout}",
        # A dead node leaves the rendezvous after interval x attempts without a heartbeat.
        f"keep_alive_interval={settings.rdzv_keep_alive_interval}",
        f"keep_alive_max_attempt={settings.rdzv_keep_alive_max_attempt}",
    ])
    return [
        # a node is a replica: its S x T ranks are the agent's workers (one with one rank per replica)
        "--nnodes", f"{settings.elastic_min_nodes}:{cfg.replicas}", "--nproc-per-node", str(cfg.ranks_per_replica),
        "--rdzv-backend", "c10d", "--rdzv-id", run_id, "--rdzv-conf", conf,
        "--max-restarts", str(settings.max_restarts), "--monitor-interval", str(settings.monitor_interval),
        "--local-addr", "127.0.0.1",
        "-m", "recover.baselines.elastic_worker", "--config", str(config_path),
    ]


class LostNodes:
    """LauncherHooks: a replica_loss fired inside a worker takes that node's agent too.

    The fault harness kills a replica's process group, but torchrun starts each
    worker in a session of its own, so on its own a replica_loss would be just a
    worker crash that the agent restarts. A lost node takes its agent: the harness
    records every fault in DIR/faults.jsonl before it takes effect, so we watch
    that record and SIGKILL the named node's agent by PID.
    """

    def __init__(self, out: Path):
        self.path = out / "faults.jsonl"
        self.pids: dict[int, list[int]] = {}
        self.seen = 0  # bytes of the record already read

    def on_start(self, pids: dict[int, list[int]], t0: float) -> None:
        self.pids = {int(r): list(p) for r, p in pids.items()}

    def on_tick(self, elapsed: float) -> None:
        try:
            if self.path.stat().st_size <= self.seen:
                return
            with open(self.path, "rb") as f:
                f.seek(self.seen)
                chunk = f.read()
        except FileNotFoundError:
            return
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
        self.seen += len(whole)
        for line in whole.decode().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if rec.get("kind") == "replica_loss" and rec.get("fired_by", "worker") == "worker":
                for pid in self.pids.get(int(rec["replica"]), []):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def on_exit(self, exit) -> None:
        pass


def supervise(
    cfg: TrainConfig, settings: BaselineConfig, config_path: Path, env: dict[str, str],
    hooks: Sequence[LauncherHooks] = (),
) -> SupervisedResult:
    out = Path(cfg.out)
    shutil.rmtree(baseline_dir(out), ignore_errors=True)
    baseline_dir(out).mkdir(parents=True)
    t0 = float(env[env_names.T0])
    args = torchrun_argv(cfg, settings, config_path, f"recover-{int(t0 * 1000)}")
    (baseline_dir(out) / "torchrun.json").write_text(json.dumps({"torchrun_args": args}, indent=1))
    launcher = Launcher(
        out,
        python_module_argv(COORDINATOR, *coordinator_args(config_path, "store")),
        lambda r: python_module_argv("recover.baselines.elastic_agent", *args),
        cfg.replicas,
        env={**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"},
        hooks=[*hooks, LostNodes(out)],
        end=UntilWorkersExit(),
    )
    result = launcher.run()
    extra: dict = {}
    final = baseline_dir(out) / "final.json"
    if final.exists():
        extra["weights_checksum"] = json.loads(final.read_text())["weights_checksum"]
    state = baseline_dir(out) / "elastic.json"
    if state.exists():
        extra["restarts"] = json.loads(state.read_text())["generation"]
    reason = result.reason
    if result.returncode == 1:
        reason = f"the elastic job could not go on: {reason}"
    return SupervisedResult(result.returncode, time.time() - t0, result.exits, reason, extra)
