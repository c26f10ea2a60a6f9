"""The benchmark commands still run: `make bench`'s micro-benchmarks and `recover bench coordinator`.

The figures themselves are never judged here (the machine is shared and noisy);
what is checked is that each benchmark runs and its benched call gives the right
answer. `make bench` times them (benchmarks/micro/test_micro.py says how).
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.procs
def test_the_micro_benchmarks_run_and_check_their_answers():
    """`make bench`'s micro-benchmarks (benchmarks/micro/), run once each with timing off:
    each asserts its call's answer, so a bench that broke, or a fast path that went
    wrong, fails the suite even though `make test` never times them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--benchmark-disable", str(root / "benchmarks" / "micro")],
                          capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "9 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.procs  # the CLI and the figure script
def test_bench_coordinator_writes_its_figures_and_votes_stay_small(tmp_path):
    """`recover bench coordinator` end to end on small R: the JSON, the figure, and a vote
    whose size does not grow with the microbatches it names (ids travel as ranges)."""
    import json
    import subprocess
    import sys

    for per_replica, name in ((8, "coordinator_state_machine"), (1024, "coordinator_state_machine_before")):
        proc = subprocess.run([sys.executable, "-m", "recover.experiments.cli", "bench", "coordinator", "--replicas",
                               "4", "16", "--per-replica", str(per_replica), "--repeats", "1", "--out", str(tmp_path),
                               "--name", name, "--no-figure"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    small, big = (json.loads((tmp_path / f"{n}.json").read_text())["rows"]
                  for n in ("coordinator_state_machine", "coordinator_state_machine_before"))
    assert [r["replicas"] for r in small] == [4, 16] and big[1]["microbatches"] == 16 * 1024
    assert all(r["commit_s"] > 0 and r["recovery_s"] > 0 for r in small + big)
    # 1024 microbatches per vote cost a few digits more than 8, not 1016 more ids
    assert big[1]["vote_bytes"] - small[1]["vote_bytes"] < 20 and big[1]["join_bytes"] < 200
    fig = Path(__file__).resolve().parents[1] / "paper_figs" / "coordinator_scale.py"
    proc = subprocess.run([sys.executable, str(fig), "--results", str(tmp_path),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "coordinator_scale.png").stat().st_size > 1000


@pytest.mark.procs  # the CLI and its client process
def test_bench_store_guard_writes_both_timings_per_client_count(tmp_path):
    """`recover bench store-guard` end to end on tiny N: both paths ran the rendezvous's reads
    (the child asserts every value it read) and the JSON has one row per N."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "recover.experiments.cli", "bench", "store-guard", "--clients", "2",
                           "5", "--repeats", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "store_guard.json").read_text())["rows"]
    assert [(r["clients"], r["requests"]) for r in rows] == [(2, 6), (5, 30)]
    assert all(r["direct_s"] > 0 and r["guarded_s"] > 0 for r in rows)
