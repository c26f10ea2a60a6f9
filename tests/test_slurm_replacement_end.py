"""When is a Slurm replacement lost (experiments/slurm_replacements.py)? Pure: no Slurm, no process.

A replacement job that ended while its ranks had all exited 0 saw the run end: it is not lost,
and no second replacement is submitted for it. On a loaded machine such a job can end before
task 0's own rank has finished and closed the bookkeeping; counting it lost then submitted a
replacement of the replacement at the run's end.
"""
from __future__ import annotations

from types import SimpleNamespace

from recover.experiments.slurm_replacements import Replacement, ReplaceOptions, SlurmReplacements


def _replacements(tmp_path) -> SlurmReplacements:
    task = SimpleNamespace(sync=tmp_path, spec=SimpleNamespace(replicas=2))
    return SlurmReplacements(task=task, root=str(tmp_path), opts=ReplaceOptions(folder=str(tmp_path), params={}),
                             replace_after=0.0, reconnect_timeout=10.0, t0=0.0, task_body=lambda *a: None)


def _ended(reps: SlurmReplacements, codes: dict[int, str], state: str = "COMPLETED") -> str:
    job = Replacement(replica=1, incarnation=1, job_id="11", submitted_at=0.0, state=state)
    folder = reps.replacement_dir(1, 1)
    folder.mkdir(parents=True, exist_ok=True)
    for rank, code in codes.items():
        (folder / f"done-{rank}").write_text(code)
    return reps._replacement_lost(job)


def test_a_job_whose_ranks_all_exited_0_is_not_lost(tmp_path):
    assert _ended(_replacements(tmp_path), {0: "0", 1: "0"}) == ""


def test_a_job_that_ended_without_a_word_from_its_ranks_is_lost(tmp_path):
    assert _ended(_replacements(tmp_path), {}, state="FAILED") == "its job ended FAILED"


def test_a_rank_that_exited_non_zero_makes_it_lost_whatever_the_jobs_state(tmp_path):
    assert _ended(_replacements(tmp_path), {0: "0", 1: "1"}, state="RUNNING") == "rank 1 exited 1"
