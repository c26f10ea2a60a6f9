"""The two throughput metrics are defined once (experiments/throughput.py) and every reader takes them from there."""
from __future__ import annotations

import math

import pytest

from recover.experiments import aggregate
from recover.experiments.sim.calibration import Costs
from recover.experiments.sim.failures import FailureEvents
from recover.experiments.sim.model import JobModel
from recover.experiments.sim.system_policies import simulate_one
from recover.experiments.sim.report import DEFINITIONS
from recover.experiments.throughput import COLUMNS, METRICS, columns, rates


def test_rates_divide_and_refuse_undefined_denominators():
    r = rates(1000.0, 400.0, 10.0, 2.0)
    assert (r.goodput_per_s, r.goodput_per_gpu_hour, r.trajectory_per_s, r.trajectory_per_gpu_hour) == (
        100.0, 500.0, 40.0, 200.0)
    r = rates(1000.0, None, 0.0, None)
    assert r == type(r)(None, None, None, None)


def test_every_reader_names_the_same_four_numbers():
    fields = set(vars(rates(1, 1, 1, 1)))
    assert set(COLUMNS["simulator"]) == set(COLUMNS["aggregate"]) == fields
    assert set(columns(rates(1, 1, 1, 1), "simulator")) == set(COLUMNS["simulator"].values())
    assert set(COLUMNS["aggregate"].values()) <= set(aggregate.SUMMARY_FIELDS)
    assert DEFINITIONS["throughput_metrics"] is METRICS


def test_simulated_torchft_goodput_exceeds_its_trajectory_equivalent_throughput():
    """A shrunk-batch system keeps training after a loss: its tokens count in goodput only."""
    job = JobModel(n_gpus=4, gpus_per_replica=1, microbatches=8, tokens_per_microbatch=100, microbatch_seconds=0.1,
                   grad_bytes=1e6, link_bandwidth=1e9, link_latency=1e-5)
    run = simulate_one("torchft", job, Costs(),
                       FailureEvents.single(1.05, 0), horizon=math.inf, max_iterations=20)
    d = run.summary()
    assert d["goodput_tokens_per_s"] == pytest.approx(d["tokens"] / d["wall_seconds"])
    assert d["effective_throughput_tokens_per_s"] == pytest.approx(d["effective_tokens"] / d["wall_seconds"])
    assert d["goodput_tokens_per_s"] > d["effective_throughput_tokens_per_s"]
    assert d["goodput_tokens_per_gpu_hour"] == pytest.approx(d["tokens"] / d["gpu_hours"])
