"""The simulator's coordinator-cost term: fitted by code to the service bench, charged per recover iteration.

Pure: a results file written here, the committed one, and closed-form simulations.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from recover.experiments.sim.calibration import Costs, coordinator_law
from recover.experiments.sim.failures import FailureEvents
from recover.experiments.sim.model import JobModel
from recover.experiments.sim.system_policies import simulate_one
from recover.experiments.sim.named_scenarios import SCENARIOS


def _bench(tmp_path, rows):
    (tmp_path / "coordinator_service.json").write_text(json.dumps(
        {"command": "recover bench coordinator --service", "rows": [{"replicas": n, "step_latency_s": y}
                                                                   for n, y in rows]}))
    return tmp_path


def test_the_law_is_the_least_squares_line_through_the_bench_rows(tmp_path):
    law = coordinator_law(_bench(tmp_path, [(n, 0.002 + 3e-5 * n) for n in (64, 512, 4096)]))
    assert law.fixed_seconds == pytest.approx(0.002) and law.per_replica_seconds == pytest.approx(3e-5)
    r = law.largest_replicas(6.0)  # 1% of a 6 s iteration: 60 ms
    assert law(r) <= 0.06 < law(r + 1)
    # a negative intercept is no cost: the fit goes through the origin instead
    law = coordinator_law(_bench(tmp_path, [(10, 0.0001), (1000, 0.2)]))
    assert law.fixed_seconds == 0.0 and law.per_replica_seconds == pytest.approx((10 * 1e-4 + 1000 * 0.2) / (1e2 + 1e6))
    assert coordinator_law(tmp_path / "nothing-here") is None


def test_cluster_scenarios_charge_the_committed_fit_at_their_replica_count():
    law = coordinator_law()
    for name in ("paper-512", "llama3-16k", "100k"):
        cal = SCENARIOS[name]().calibration
        assert cal.costs.recover_commit_seconds == pytest.approx(law(cal.job.replicas))
        assert cal.costs.recover_commit_seconds > 0
        assert "coordinator_service.json" in cal.sources["recover_commit_seconds"]
    local = SCENARIOS["local"]().calibration  # already inside the measured iteration time
    assert local.costs.recover_commit_seconds == 0.0


def test_every_recover_iteration_pays_the_commit_and_only_recover_does():
    job = JobModel(n_gpus=64, gpus_per_replica=8, microbatches=64, microbatch_seconds=0.1)
    free, paid = Costs(), replace(Costs(), recover_commit_seconds=0.05)
    n = 40
    for system, extra in (("recover", n * 0.05), ("ckpt-restart", 0.0)):
        a = simulate_one(system, job, free, FailureEvents.none(), horizon=float("inf"), max_iterations=n)
        b = simulate_one(system, job, paid, FailureEvents.none(), horizon=float("inf"), max_iterations=n)
        assert b.wall_seconds - a.wall_seconds == pytest.approx(extra)
    # a faulted iteration pays it too: the redo round ends with a commit
    crash = FailureEvents.single(0.05, 3)
    a = simulate_one("recover", job, free, crash, horizon=float("inf"), max_iterations=1)
    b = simulate_one("recover", job, paid, crash, horizon=float("inf"), max_iterations=1)
    assert b.wall_seconds - a.wall_seconds == pytest.approx(0.05)
