"""What a checkpoint-restart's restart record counts as lost, from the work log (baselines/runlog.py).

The restart record's work_lost_steps (baselines/trainer.py) takes the furthest step the failed
incarnation began: a step begun proves the ones before it finished their all-reduce on every
member, so they count as redone even when rank 0 was torn down before writing their metrics
lines. The furthest step is the failed incarnation's own, not an older one's that got further
before an earlier restart. Pure: files only.
"""
from __future__ import annotations

from recover.baselines.runlog import WorkLog, furthest_step_begun


def test_the_furthest_step_is_the_incarnations_own(tmp_path):
    first = WorkLog(tmp_path, 0, generation=0)
    for step in range(11):  # incarnation 0 got to step 10, then restarted from a checkpoint at 8
        first.begin(step, step * 2)
    first.close()
    second = WorkLog(tmp_path, 1, generation=1)
    second.begin(8, 16)
    second.begin(9, 18)  # incarnation 1 failed in step 9
    second.close()
    assert furthest_step_begun(tmp_path) == 10  # any incarnation, as before
    assert furthest_step_begun(tmp_path, 1) == 9 and furthest_step_begun(tmp_path, 0) == 10
    assert furthest_step_begun(tmp_path, 2) == -1
