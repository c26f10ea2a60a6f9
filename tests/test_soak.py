"""The coordinator's state machine holds flat over a long run with replacements.

experiments/benches/soak.py drives core.coordinator.protocol.ProtocolStateMachine in process, a member lost
mid-step and its replacement admitted every few steps. Checked on counts, not time:
every container the state machine holds is no larger in the second half of a few
thousand steps than in the first, the process opens no file, and the metrics line does
not grow with M. `recover bench soak` measures the same over 100,000 steps.
"""
from __future__ import annotations

import json

import pytest

from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.experiments.benches.soak import container_sizes, run_soak


def test_the_state_machine_holds_flat_over_thousands_of_steps_with_replacements():
    r = run_soak(replicas=4, per_replica=2, steps=3000, every=50, sample_every=250)
    assert r["losses"] == r["admissions"] == 59  # steps 50, 100, ..., 2950: each lost member replaced
    s = r["summary"]
    assert s["grown"] == []
    for name, c in s["containers"].items():
        assert c["max"] <= c["max_first_half"], (name, c)
    assert s["fds_first"] == s["fds_last"]
    assert s["containers"]["members"]["last"] == 4 and s["containers"]["dead"]["last"] == 0


def test_the_soak_notices_a_container_that_grows_with_the_replacements(monkeypatch):
    """The check is not vacuous: a list that took one entry per admission would be named."""
    admit = ProtocolStateMachine._admit

    def leaky(self, now):
        self.__dict__.setdefault("admitted_log", []).append(now)
        return admit(self, now)

    monkeypatch.setattr(ProtocolStateMachine, "_admit", leaky)
    r = run_soak(replicas=3, per_replica=2, steps=400, every=20, sample_every=50)
    assert r["summary"]["grown"] == ["admitted_log"]


def test_the_metrics_line_does_not_grow_with_the_microbatches():
    small = run_soak(replicas=3, per_replica=2, steps=60, every=20, sample_every=30)
    large = run_soak(replicas=3, per_replica=20_000, steps=60, every=20, sample_every=30)
    assert large["microbatches"] == 60_000
    # a few digits longer (bigger ids), not 60,000 numbers
    assert large["summary"]["metrics_line_bytes_max"] < small["summary"]["metrics_line_bytes_max"] + 100
    json.dumps(large)  # the result is JSON as written


def test_container_sizes_reads_dicts_slots_and_arrays_one_level_down():
    proto = ProtocolStateMachine(3, 6, 10, join_timeout=30.0, now=0.0)
    sizes = container_sizes(proto)
    assert sizes["keys"] == 3 and sizes["speeds._speed"] == 3 and sizes["votes.votes"] == 0


@pytest.mark.procs  # starts workers through the launcher
def test_the_launcher_soak_starts_each_worker_and_samples_flat_descriptors(tmp_path):
    from recover.experiments.benches.soak import run_launcher_soak

    result = run_launcher_soak(6, 3, tmp_path)
    assert [s["starts"] for s in result["samples"]] == [0, 3, 6]
    assert result["summary"]["fds_last"] <= result["summary"]["fds_first"]
