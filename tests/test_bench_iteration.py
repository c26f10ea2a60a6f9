"""`recover bench iteration`'s pure parts: how a run's iteration is timed, the baseline shim, the flags."""
from __future__ import annotations

import json

from conftest import run_recover  # noqa: F401 - the suite's helpers (sys.path)

from recover.experiments.benches.iteration import _iteration_seconds, _shim
from recover.experiments.cli import main


def test_a_runs_iteration_is_the_median_gap_after_the_first_two_steps(tmp_path):
    walls = [0.0, 5.0, 5.5, 5.6, 5.8, 5.9]  # steps 0 and 1 pay first calls: left out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "wall_time": w}) + "\n"
                                                    for i, w in enumerate(walls)))
    assert abs(_iteration_seconds(tmp_path / "metrics.jsonl") - 0.1) < 1e-9  # gaps 0.1, 0.2, 0.1


def test_the_baseline_shim_maps_every_folder_onto_the_other_tree(tmp_path):
    tree = tmp_path / "tree"
    for d in ("core", "baselines", "fault_injection", "experiments"):
        (tree / d).mkdir(parents=True)
    shim = _shim(tree, tmp_path / "shim")
    assert sorted(p.name for p in (shim / "recover").iterdir()) == ["baselines", "core", "experiments",
                                                                     "fault_injection"]
    assert (shim / "recover" / "core").resolve() == (tree / "core").resolve()


def test_bad_flags_are_refused_before_any_run(capsys, tmp_path):
    assert main(["bench", "iteration", "--layouts", "3y2"]) != 0
    assert "is not RxS" in capsys.readouterr().err
    assert main(["bench", "iteration", "--baseline-tree", str(tmp_path)]) != 0
    assert "not a checkout" in capsys.readouterr().err
