"""Seeded failure samplers and generated plans: pure, reproducible, well-formed, and with the
distribution they claim."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_recover

from recover.fault_injection.generate import MODELS, SAMPLE_KINDS, sample_plan
from recover.fault_injection.plan import FaultPlan, load_plan, validate_plan
from recover.fault_injection.sampling import (
    exponential_failure_times,
    spread_losses,
    weibull_failure_times,
    weibull_scale,
)


def _draw(kind: str, seed: int, n: int, mtbf: float, horizon: float, renewal: bool, shape: float = 1.5):
    rng = np.random.default_rng(seed)
    if kind == "exponential":
        return exponential_failure_times(rng, n, mtbf, horizon, renewal=renewal)
    return weibull_failure_times(rng, n, mtbf, shape, horizon, renewal=renewal)


@given(
    kind=st.sampled_from(["exponential", "weibull"]),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 300),
    mtbf=st.floats(0.1, 1e4),
    horizon=st.floats(0.0, 1e4),
    renewal=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_failure_times_are_sorted_inside_the_horizon_and_reproducible(kind, seed, n, mtbf, horizon, renewal):
    times = _draw(kind, seed, n, mtbf, horizon, renewal)
    assert times == _draw(kind, seed, n, mtbf, horizon, renewal)
    assert times == sorted(times)
    assert all(0 <= t < horizon and 0 <= g < n for t, g in times)
    if not renewal:  # no replacement: a GPU fails at most once
        gpus = [g for _, g in times]
        assert len(gpus) == len(set(gpus))


@pytest.mark.parametrize("kind, shape", [("exponential", 1.0), ("weibull", 0.7), ("weibull", 2.0)])
def test_lifetimes_have_the_mean_asked_for(kind, shape):
    # With an endless horizon every GPU fails once: the times are the lifetimes.
    # 200k draws: the sample mean's relative standard error is below 0.5%.
    times = _draw(kind, 1234, 200_000, 10.0, math.inf, False, shape)
    assert len(times) == 200_000
    assert np.mean([t for t, _ in times]) == pytest.approx(10.0, rel=0.02)


def test_weibull_scale_makes_the_mean_the_mtbf():
    assert weibull_scale(10.0, 1.0) == pytest.approx(10.0)  # shape 1 is the exponential
    assert weibull_scale(10.0, 2.0) * math.gamma(1.5) == pytest.approx(10.0)


def test_exponential_failures_in_a_short_horizon_match_the_rate():
    # P(a GPU fails within h) = 1 - exp(-h/mtbf): 100k GPUs, mtbf 1000 h, 30 h -> ~2955.
    n = len(exponential_failure_times(np.random.default_rng(7), 100_000, 1000.0, 30.0))
    expected = 100_000 * (1 - math.exp(-0.03))
    assert abs(n - expected) < 5 * math.sqrt(expected)


def test_spread_losses_are_evenly_spaced_distinct_and_deterministic():
    assert spread_losses(2, 4, 9.0) == [(3.0, 3), (6.0, 2)]
    assert spread_losses(0, 4, 9.0) == []
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    a, b = spread_losses(5, 8, 12.0, rng_a), spread_losses(5, 8, 12.0, rng_b)
    assert a == b
    assert [t for t, _ in a] == pytest.approx([2.0, 4.0, 6.0, 8.0, 10.0])
    assert len({u for _, u in a}) == 5 and all(0 <= u < 8 for _, u in a)
    with pytest.raises(ValueError):
        spread_losses(5, 4, 1.0)


# ---- generated plans ----------------------------------------------------------------------------
plan_args = st.fixed_dictionaries({
    "model": st.sampled_from(MODELS),
    "replicas": st.integers(1, 16),
    "steps": st.integers(1, 200),
    "seed": st.integers(0, 2**32 - 1),
    "mtbf_hours": st.floats(0.5, 500.0),
    "shape": st.floats(0.3, 4.0),
    "hours": st.floats(0.5, 100.0),
    "gpus_per_replica": st.integers(1, 8),
    "kind": st.sampled_from(SAMPLE_KINDS),
    "hang_seconds": st.one_of(st.none(), st.floats(0.1, 60.0)),
})


@given(plan_args)
@settings(max_examples=80, deadline=None)
def test_generated_plans_are_identical_for_identical_seeds_and_round_trip(args):
    args = dict(args)
    model, replicas, steps, seed = args.pop("model"), args.pop("replicas"), args.pop("steps"), args.pop("seed")
    plan = sample_plan(model, replicas, steps, seed, **args)
    assert plan == sample_plan(model, replicas, steps, seed, **args)
    assert FaultPlan.from_json(plan.to_json()) == plan
    validate_plan(plan, replicas, steps)
    lost = [f.replica for f in plan.faults]
    assert len(lost) == len(set(lost))  # a replica is lost once
    assert [(f.step, f.replica) for f in plan.faults] == sorted((f.step, f.replica) for f in plan.faults)
    assert plan.generator["seed"] == seed and plan.generator["model"] == model
    if model == "spread":
        assert len(plan.faults) == replicas // 2  # the paper's schedule: half of them


def test_spread_plan_spaces_its_losses_over_the_run():
    plan = sample_plan("spread", 8, 100, seed=3, lose=4)
    assert [f.step for f in plan.faults] == [20, 40, 60, 80]


@pytest.mark.procs
def test_recover_faults_sample_writes_the_same_plan_for_the_same_seed(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        run_recover("faults", "sample", "--model", "weibull", "--replicas", "8", "--steps", "50", "--seed", "11",
                    "--mtbf-hours", "20", "--shape", "0.8", "--hours", "10", "--out", str(path), check=True,
                    timeout=60)
    assert a.read_text() == b.read_text()
    plan = load_plan(a)
    validate_plan(plan, 8, 50)
    assert plan.generator["shape"] == 0.8 and json.loads(a.read_text())["generator"]["seed"] == 11


def test_recover_faults_sample_rejects_a_bad_flag_in_one_line(capsys):
    from recover.experiments.cli import main

    assert main(["faults", "sample", "--replicas", "4", "--steps", "5", "--lose", "9"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "recover: error: --lose: must be in 0..4 (the replicas of the run), got 9"
    ]
