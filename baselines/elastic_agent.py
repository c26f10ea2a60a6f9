"""Becomes a `torchrun` agent pointed at this run's rendezvous store: `python -m recover.baselines.elastic_agent ARGS`.

Contract: reads the store's address from RECOVER_STORE_ADDR (the launcher learns
it only once the store process is up) and replaces this process, by exec, with
`python -m torch.distributed.run --rdzv-endpoint HOST:PORT ARGS`. The PID the
launcher recorded is then the agent's own, so killing it by PID is losing the node.
"""
from __future__ import annotations
from recover.core.contract import env_names

import os
import sys


def main() -> None:
    endpoint = os.environ[env_names.STORE_ADDR]
    argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-endpoint", endpoint, *sys.argv[1:]]
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
