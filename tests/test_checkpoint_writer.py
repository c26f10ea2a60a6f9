"""Who writes a checkpoint: the lowest member of the generation that committed the step.

`_Checkpointer.after_step` runs from `Replica.after_step`, right after the optimizer
step and before an admitting generation switches `members`. A newcomer admitted at
that step (not in the committing generation) never writes, even when it becomes the
lowest member; the committing generation's lowest member does. A follower rank of a
replica of many ranks reads the same members from its leader's relay. Pure: a fake
replica, link and saver, no processes.
"""
from __future__ import annotations

from types import SimpleNamespace

from recover.core.training.resilient import _Checkpointer


class _Saver:
    pending = None

    def __init__(self):
        self.saved: list[int] = []

    def poll(self):
        pass

    def wait(self):
        pass

    def save(self, step, fault_step):
        self.saved.append(step)
        return True


def _writer(replica_id: int) -> _Checkpointer:
    c = object.__new__(_Checkpointer)
    c.replica_id, c.every, c.steps, c.max_failures, c.failures, c.started = replica_id, 2, 10, 3, 0, {}
    c.saver = _Saver()
    return c


def _after_step(replica_id: int, step: int, committed: list[int], members: list[int]) -> list[int]:
    c = _writer(replica_id)
    c.after_step(SimpleNamespace(replica=replica_id, step=step, committed_members=committed, members=members))
    return c.saver.saved


def test_the_lowest_member_of_the_committing_generation_writes_not_a_newcomer():
    # step 3 committed by [1, 2]; newcomer 0 admitted for step 4 (members already switched)
    assert _after_step(0, 4, committed=[1, 2], members=[0, 1, 2]) == []
    assert _after_step(1, 4, committed=[1, 2], members=[0, 1, 2]) == [4]
    assert _after_step(2, 4, committed=[1, 2], members=[0, 1, 2]) == []


def test_only_due_steps_are_written_and_never_the_last():
    assert _after_step(0, 3, committed=[0, 1], members=[0, 1]) == []
    assert _after_step(0, 10, committed=[0, 1], members=[0, 1]) == []  # step 10 = --steps: the run is over
    assert _after_step(0, 2, committed=[0, 1], members=[0, 1]) == [2]


def test_a_follower_rank_reads_the_writer_rule_from_its_leaders_end_message():
    # A stop for a non-finite loss: the leader's end relays its members and committed count, so
    # a follower rank of the lowest member joins the stopped state's save, as its leader does.
    import pytest

    from recover.core.parallel.follower import ReplicaFollower
    from recover.core.worker.replica import RunEnded

    class _Link:
        def share(self):
            return {"t": "end", "reason": "non-finite loss", "fenced": False, "code": 1, "committed": 4,
                    "members": [1, 2]}

    f = object.__new__(ReplicaFollower)  # no constructor: it installs the process's exit hook
    f.replica, f.local_rank, f.link, f.members = 1, 1, _Link(), []
    with pytest.raises(RunEnded) as ended:
        f._next("quota")
    assert ended.value.committed == 4 and f.members == [1, 2]
    for replica_id, saved in ((1, [4]), (2, [])):
        c = _writer(replica_id)
        c.save_stopped(SimpleNamespace(replica=replica_id, step=4, generation=3, members=f.members),
                       ended.value.committed)
        assert c.saver.saved == saved
