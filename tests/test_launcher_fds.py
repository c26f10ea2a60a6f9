"""The launcher holds no descriptor per worker it started: a worker's log is
the child's own copy, so a run with a replacement every hour keeps its descriptors flat."""
from __future__ import annotations

import os
import sys

import pytest

from recover.core.launch.launcher import Launcher


@pytest.mark.procs  # starts workers
def test_starting_and_reaping_workers_leaves_the_launchers_descriptors_flat(tmp_path):
    (tmp_path / "logs").mkdir()
    launcher = Launcher(tmp_path, [sys.executable, "-c", "pass"],
                        lambda r: [sys.executable, "-c", f"print('worker {r}')"], 2, fork_workers=False)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(30):
        proc = launcher._start_rank(i % 2, 0, dict(os.environ))
        assert proc.wait(timeout=60) == 0
    assert len(os.listdir("/proc/self/fd")) <= before
    assert (tmp_path / "logs" / "replica0.log").read_text().count("worker 0") == 15

