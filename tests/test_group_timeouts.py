"""The checkpoint-restart baseline's checkpoint group keeps the collective timeout.

`dist.new_group` does not inherit the default group's timeout: without one of its own the
gloo group DCP's collectives run on gets gloo's 30-minute default, and a survivor of a peer
lost mid-save waits that long (an elastic run of the suite hung inside such a save). Checked
on the group `ckpt_worker.init_groups` returns, in a process of its own (the default group
is process-global), with a one-rank world over a HashStore.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import torch, torch.distributed as dist
from recover.baselines.ckpt_worker import init_groups
group = init_groups("gloo", dist.HashStore(), 0, 1, 7.0)
print(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


@pytest.mark.procs
def test_the_checkpoint_group_has_the_collective_timeout_not_gloos_default():
    p = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout.split()[-1]) == 7.0, p.stdout
