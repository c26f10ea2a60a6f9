"""A follower rank ends like its leader: one line and the documented exit code, no traceback.

Under `recover launch`, a rank that is not its replica's leader learns that the run ended
for it (fenced, stopped, the coordinator gone) from its leader's relay, as a `RunEnded`
with the leader's code. Only `Replica.__init__` installed the exit hook, so such a rank
printed a traceback and exited 1. Here a follower is built, in a process of its own, over
a relay whose first word is that end (code 3, fenced): the process exits 3 with one line.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs

SCRIPT = """
import torch
from recover.core.parallel.follower import ReplicaFollower

class Link:
    leader = False
    def share(self):
        return {"t": "end", "reason": "fenced by the coordinator: no progress", "fenced": True, "code": 3}

p = torch.nn.Parameter(torch.zeros(2))
class Acc:
    params = [p]
ReplicaFollower(Acc(), torch.optim.SGD([p], lr=0.1), replica=1, local_rank=1, link=Link(), open_store=None)
"""


def test_a_follower_told_the_run_ended_exits_with_the_leaders_code_and_one_line():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "replica 1 rank 1 exits with code 3: fenced by the coordinator: no progress" in proc.stderr, proc.stderr
