"""torchft's lighthouse as the job's coordinator process: `python -m recover.baselines.torchft_lighthouse`.

Contract:
- Runs torchft's own `LighthouseServer` (the Rust quorum service that the wheel's
  `torchft_lighthouse` command also runs) bound to a port the OS picks, so no two
  runs on one machine collide and there is no pick-then-bind race.
- Speaks the launcher's coordinator protocol: its first stdout line is
  {"host", "store_port": 0, "control_port": <lighthouse port>}, so workers find
  the lighthouse at http://$RECOVER_CONTROL_ADDR. There is no c10d store here:
  each torchft replica group hosts its own, as torchft expects.
- Runs until SIGTERM/SIGINT (the launcher's cleanup), then shuts the server down.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address workers reach the lighthouse at")
    ap.add_argument("--min-replicas", type=int, required=True)
    ap.add_argument("--join-timeout-ms", type=int, required=True)
    ap.add_argument("--heartbeat-timeout-ms", type=int, required=True)
    args = ap.parse_args(argv)

    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    port = int(server.address().rsplit(":", 1)[1].strip("/"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"host": args.host, "store_port": 0, "control_port": port}), flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
