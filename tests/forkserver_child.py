"""Run by tests/test_forkserver.py through the fork server: reports what it sees, then acts."""
import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    action = sys.argv[1]
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                      "argv": sys.argv[1:], "probe": os.environ.get("PROBE"), "n_env": len(os.environ),
                      "torch_loaded": "torch" in sys.modules,
                      "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                      "caught": sorted(s.name for s in signal.valid_signals() if callable(signal.getsignal(s))
                                       and signal.getsignal(s) is not signal.default_int_handler),
                      "recover_modules": sorted(m for m in sys.modules if m.startswith("recover"))}), flush=True)
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise RuntimeError("boom")
    time.sleep(float(sys.argv[2]))  # "sleep": wait to be killed
