"""`recover bench iteration`'s pure parts: how a run's iteration is timed, the baseline shim, the flags."""
from __future__ import annotations

import json

import pytest

from conftest import run_recover  # noqa: F401 - the suite's helpers (sys.path)

from recover.experiments.benches.iteration import _iteration_seconds, _shim, layout_name, over_plain, parse_layout
from recover.experiments.cli import main


def test_a_runs_iteration_is_the_median_gap_after_the_first_two_steps(tmp_path):
    walls = [0.0, 5.0, 5.5, 5.6, 5.8, 5.9]  # steps 0 and 1 pay first calls: left out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "wall_time": w}) + "\n"
                                                    for i, w in enumerate(walls)))
    assert abs(_iteration_seconds(tmp_path / "metrics.jsonl") - 0.1) < 1e-9  # gaps 0.1, 0.2, 0.1


def test_a_systems_cost_over_plain_is_the_median_of_its_rounds_ratios_with_their_spread():
    # round 2 ran on a loaded machine: both systems slow; the per-round ratio stays put
    rec = over_plain([1.10, 2.30, 1.05], [1.00, 2.00, 1.00])
    assert rec["per_round"] == [1.10 / 1.00, 2.30 / 2.00, 1.05 / 1.00]
    assert rec["over_plain"] == rec["recover_over_plain"] == 1.10
    assert (rec["over_plain_min"], rec["over_plain_max"]) == (1.05, 2.30 / 2.00)
    ft = over_plain([1.3, 1.2], [1.0, 1.0], "torchft")
    assert "recover_over_plain" not in ft and abs(ft["over_plain"] - 1.25) < 1e-12


def test_the_baseline_shim_maps_every_folder_onto_the_other_tree(tmp_path):
    tree = tmp_path / "tree"
    for d in ("core", "baselines", "fault_injection", "experiments"):
        (tree / d).mkdir(parents=True)
    shim = _shim(tree, tmp_path / "shim")
    assert sorted(p.name for p in (shim / "recover").iterdir()) == ["baselines", "core", "experiments",
                                                                     "fault_injection"]
    assert (shim / "recover" / "core").resolve() == (tree / "core").resolve()


def test_a_layout_is_replicas_ranks_and_pipeline_stages():
    assert parse_layout("4") == (4, 1, 1) and parse_layout("3x2") == (3, 2, 1) and parse_layout("2x2p2") == (2, 2, 2)
    assert [layout_name(*parse_layout(s)) for s in ("4", "3x2", "2x1p2")] == ["4x1", "3x2", "2x1p2"]
    for bad in ("3y2", "3x0", "0x2", "2p2", "2x2p0", "2x2p", "x2", ""):
        assert parse_layout(bad) is None, bad


def test_bad_flags_are_refused_before_any_run(capsys, tmp_path):
    assert main(["bench", "iteration", "--layouts", "2x2p0"]) != 0
    assert "is not RxS" in capsys.readouterr().err
    assert main(["bench", "iteration", "--layouts", "3y2"]) != 0
    assert "is not RxS" in capsys.readouterr().err
    assert main(["bench", "iteration", "--baseline-tree", str(tmp_path)]) != 0
    assert "not a checkout" in capsys.readouterr().err


@pytest.mark.procs  # the result's machine line runs `uname -p` (platform.platform)
def test_a_system_is_measured_only_at_the_layouts_it_runs_and_the_others_are_named(capsys, tmp_path, monkeypatch):
    # every registered system runs the RxS layouts this bench takes; the bench asks the table, so a
    # system the table gives one rank per replica (elastic, as it was) has nothing to run at 3x2
    from recover.core.config import layouts

    monkeypatch.setitem(layouts.SYSTEM_LAYOUTS, "elastic", ())
    assert main(["bench", "iteration", "--layouts", "3x2", "--systems", "elastic", "--repeats", "1",
                 "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert ("elastic at 3x2: not measured (elastic runs one rank per replica; 3 x S2 needs recover, plain, "
            "torchft or ckpt-restart)") in out
    assert json.loads((tmp_path / "iteration.json").read_text())["rows"] == []


def test_the_profile_sums_each_steps_phases_per_process_and_summarizes_them_per_role(tmp_path, monkeypatch):
    """--profile's recorder (experiments/benches/phases.py), in this process: a relay is named by its
    message kind, a step ends with the optimizer step, and what it writes at exit is summarized per role."""
    from recover.experiments.benches import phases

    rec = phases._Recorder(str(tmp_path), "PROFILE_TEST_REPLICA", "PROFILE_TEST_LOCAL")

    class ReplicaLink:
        def share(self, obj=None):
            return obj if obj is not None else {"t": "id"}

    class CommittedStep:
        def __call__(self, step):
            return 0.0

    rec.wrap(ReplicaLink, "share", "kind")
    rec.wrap(CommittedStep, "__call__", None)
    rec.wrap(ReplicaLink, "no_such_method", None)  # a tree without it: skipped
    link, stepper = ReplicaLink(), CommittedStep()
    for step in range(4):
        link.share({"t": "quota"})
        link.share()
        link.share()
        stepper(step)
    monkeypatch.setenv("PROFILE_TEST_REPLICA", "1")
    monkeypatch.setenv("PROFILE_TEST_LOCAL", "1")
    rec.write()
    rec.write()  # once only (atexit and os._exit both call it)
    (written,) = tmp_path.glob("*-r1-l1-*.json")
    assert [sorted(s) for s in json.loads(written.read_text())["steps"]] == \
        [["CommittedStep.__call__", "ReplicaLink.share:id", "ReplicaLink.share:quota"]] * 4
    (role, row), = phases.summarize(tmp_path, skip=1).items()
    assert role.endswith("-follower") and {"step", "ReplicaLink.share:id", "ReplicaLink.share:quota"} <= set(row)
    assert all(v >= 0 for v in row.values())
    compile(phases.site_source(tmp_path, "A", "B"), "sitecustomize.py", "exec")  # what a run imports first
