"""A step's ids on a metrics line: id ranges now, a plain id list before.

Contract (core/storage/results.py): writers put `microbatch_id_ranges`, a canonical range
list; lines written earlier carry `microbatch_ids`, the sorted id list. Every reader
goes through `step_id_ranges` / `step_ids` / `step_ids_are`, which accept both, so
the results committed under results/ (all in the old form) read and aggregate to the
same numbers whichever form their lines are in.
"""
from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import pytest

from recover.core.storage.results import (IDS, OLD_IDS, metric_record, step_id_ranges, step_ids, step_ids_are)
from recover.experiments.aggregate import aggregate
from recover.experiments.sim.validation import find_runs, load_run, measure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
EXPERIMENTS = ("throughput", "recovery", "trajectory")


def test_a_writer_puts_ranges_and_the_readers_take_both_forms():
    new = metric_record(3, 1.5, 100, [13, 12, 17, 14], 0, [1, 0], time.time())
    assert new[IDS] == [[12, 15], [17, 18]] and OLD_IDS not in new
    old = {"step": 3, OLD_IDS: [12, 13, 14, 17]}
    for line in (new, old):
        assert step_id_ranges(line) == [[12, 15], [17, 18]]
        assert step_ids(line) == [12, 13, 14, 17]
        assert not step_ids_are(line, 12, 18)
    assert step_ids_are({IDS: [[8, 16]]}, 8, 16) and step_ids_are({OLD_IDS: list(range(8, 16))}, 8, 16)
    # not canonical on the line (touching pairs): still compared as the same ids
    assert step_id_ranges({IDS: [[8, 12], [12, 16]]}) == step_id_ranges({OLD_IDS: list(range(8, 16))}) == [[8, 16]]
    assert step_ids({IDS: []}) == step_ids({OLD_IDS: []}) == []
    with pytest.raises(ValueError, match="named twice"):
        metric_record(0, 1.0, 1, [2, 2], 0, [0], 0.0)  # an id folded twice is never written as one step
    with pytest.raises(ValueError, match="no ids"):
        step_ids({"step": 4})
    with pytest.raises(ValueError, match="bad id range"):
        step_ids({IDS: [[3, 3]]})


def test_a_line_stays_small_however_many_ids_its_step_has():
    M = 16_384 * 4
    line = json.dumps(metric_record(7, 1.0, M, range(7 * M, 8 * M), 0, [0], 0.0))
    assert len(line) < 200 and json.loads(line)[IDS] == [[7 * M, 8 * M]]


def _rewrite_ids(root: Path, to_ranges: bool) -> int:
    """Rewrite every metrics.jsonl under `root` with its step ids in the range form (`to_ranges`) or
    as the plain list; returns the lines rewritten."""
    src, dst, convert = (OLD_IDS, IDS, step_id_ranges) if to_ranges else (IDS, OLD_IDS, step_ids)
    n = 0
    for p in root.rglob("metrics.jsonl"):
        # the lines as written (read_metrics would expand the compact members: a rewrite keeps them)
        lines = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        for m in lines:
            if src in m:
                m[dst] = convert(m)
                del m[src]
                n += 1
        p.write_text("".join(json.dumps(m) + "\n" for m in lines))
    return n


def _to_new_form(root: Path) -> int:
    return _rewrite_ids(root, to_ranges=True)


def _to_old_form(root: Path) -> int:
    return _rewrite_ids(root, to_ranges=False)


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_committed_results_aggregate_to_the_same_numbers_in_either_form(tmp_path: Path, experiment: str):
    if not (RESULTS / experiment).is_dir():
        pytest.skip(f"no committed results/{experiment}")
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(RESULTS / experiment, old / experiment)
    shutil.copytree(RESULTS / experiment, new / experiment)
    # results committed before the range form are rewritten forward, those written after it backward
    assert _to_new_form(new) > 0 or _to_old_form(old) > 0
    a_steps, a_summary, _ = aggregate(old, experiment)
    b_steps, b_summary, _ = aggregate(new, experiment)
    assert a_steps.read_text() == b_steps.read_text()
    assert a_summary.read_text() == b_summary.read_text()
    # and the old form still gives the numbers committed beside the runs
    assert _csv(a_summary) == _csv(RESULTS / f"{experiment}_summary.csv")
    assert _csv(a_steps) == _csv(RESULTS / f"{experiment}.csv")
    # a reference in the old form against runs in the new one (a results tree written across the change)
    mixed = tmp_path / "mixed"
    shutil.copytree(new / experiment, mixed / experiment)
    for d in (old / experiment).iterdir():
        if d.name.startswith("failure-free") and (d / "metrics.jsonl").is_file():
            shutil.copy(d / "metrics.jsonl", mixed / experiment / d.name / "metrics.jsonl")
    c_steps, c_summary, _ = aggregate(mixed, experiment)
    assert c_steps.read_text() == a_steps.read_text() and c_summary.read_text() == a_summary.read_text()


def test_the_simulator_validation_measures_either_form_alike(tmp_path: Path):
    runs = [d for e in EXPERIMENTS if (RESULTS / e).is_dir() for d in find_runs(RESULTS / e)]
    if not runs:
        pytest.skip("no committed runs")
    for d in runs[:12]:
        copy = tmp_path / d.relative_to(RESULTS)
        shutil.copytree(d, copy)
        _to_new_form(copy)
        assert measure(load_run(copy)) == measure(load_run(d)), d
