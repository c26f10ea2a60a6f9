"""The local calibration's measurements are computed by code from committed results (experiments/sim/measured.py)."""
from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import pytest

from recover.experiments.sim.measured import (MEASURED_KEYS, REAL_DIR, fit_microbatch_and_latency, local_measured,
                                              ring_allreduce)
from recover.experiments.sim.realruns import find_runs, load_run, restart_samples


def test_fit_recovers_the_microbatch_time_and_latency_it_was_given():
    tmb, lat = 0.01, 0.002
    # 2 cores: R=2 computes 4 microbatches, R=4 two each at half speed (4 microbatch-times) at M=8
    steps = {2: 4 * tmb + ring_allreduce(2, lat), 4: 2 * 2 * tmb + ring_allreduce(4, lat)}
    got = fit_microbatch_and_latency(steps, 8)
    assert got == pytest.approx((tmb, lat))


def test_every_local_value_comes_from_a_committed_file():
    m = local_measured()
    assert set(m) == set(MEASURED_KEYS)
    for key, (value, source) in m.items():
        assert value > 0 and source.startswith("computed:"), (key, value, source)
    # the restart is the median over the committed ckpt-restart runs' restarts, as realruns reads them
    runs = [load_run(p) for p in find_runs(REAL_DIR) if load_run(p).config["train"]["system"] == "ckpt-restart"]
    ref = load_run(runs[0].path.parent / "plain")
    w = [x["wall_time"] for x in ref.metrics]
    step = statistics.median(sorted(b - a for a, b in zip(w, w[1:])))
    xs = [x for r in runs for x in restart_samples(r, step, m["checkpoint_load_seconds"][0])]
    assert len(xs) >= 2 and m["restart_seconds"][0] == pytest.approx(statistics.median(xs))


def test_missing_measurements_raise_instead_of_falling_back(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        local_measured(tmp_path / "nowhere")
    shutil.copytree(REAL_DIR / "batch1", tmp_path / "real" / "batch1")  # no 2-/4-replica failure-free pair
    with pytest.raises(ValueError, match="2 and 4 replicas"):
        local_measured(tmp_path / "real")
