"""A terminal progress bar for a run, fed by tailing DIR/metrics.jsonl.

Contract: a `LauncherHooks` observer; it only reads files, so it works the same for
every system whichever process writes the metrics.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from tqdm import tqdm

from recover.core.launch.launcher import ProcessExit
from recover.core.storage.results import parse_metrics_line


class MetricsProgress:
    """Shows committed steps, the latest loss and the generation as a tqdm bar."""

    def __init__(self, out: str, steps: int, enabled: bool = True):
        self.path = Path(out) / "metrics.jsonl"
        self.steps = steps
        self.enabled = enabled
        self.bar: tqdm | None = None
        self._pos = 0
        self._buf = ""
        self._ino: int | None = None
        self.last: dict | None = None

    def on_start(self, pids, t0) -> None:
        if self.enabled and self.bar is None:  # a restarted job starts again: keep one bar
            self.bar = tqdm(total=self.steps, unit="step", dynamic_ncols=True, file=sys.stderr)

    def on_tick(self, elapsed: float) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            # A restarting baseline replaces metrics.jsonl by a shorter file (the
            # steps it redoes are dropped): then read the new file from the start.
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self._pos:
                self._ino, self._pos, self._buf = st.st_ino, 0, ""
            f.seek(self._pos)
            chunk = f.read()
            self._pos = f.tell()
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if not line.strip():
                continue
            rec = parse_metrics_line(line)
            self.last = rec
            if self.bar is not None:
                self.bar.n = rec["step"] + 1
                self.bar.set_postfix(loss=f"{rec['loss']:.4f}", gen=rec.get("generation", 0), refresh=False)
                self.bar.refresh()

    def on_exit(self, exit: ProcessExit) -> None:
        if exit.returncode not in (0, None) and self.bar is not None:
            who = "coordinator" if exit.replica < 0 else f"replica {exit.replica}"
            self.bar.write(f"{who} (pid {exit.pid}) {exit.how} at {exit.at:.2f}s")

    def close(self) -> None:
        self.on_tick(0.0)
        if self.bar is not None:
            self.bar.close()
