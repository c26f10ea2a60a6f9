"""Which system runs which replica layout: core/config/layouts.py's table, its one-line refusals, and
that every entry point (TrainConfig.validate for `recover train`, the grids' check_layout,
`recover bench recovery`) refuses with that same line. Pure and fast: nothing starts."""
from __future__ import annotations

import itertools
from argparse import Namespace

import pytest

from recover.core.config.layouts import LAYOUT_DIMENSIONS, SYSTEM_LAYOUTS, layout_words, refusal, runs
from recover.core.config.train_config import ConfigError, TrainConfig
from recover.experiments.commands.bench import cmd_bench_recovery
from recover.core.config.replica_layout import ReplicaLayout
from recover.experiments.systems import SYSTEMS, check_layout, runs_layout

BASELINES = ("ckpt-restart", "torchft", "elastic")
# (shard, tp, pp): one rank, every dimension alone, and every pair and the triple
LAYOUTS = [(s, t, p) for s, t, p in itertools.product((1, 2), repeat=3)]
CELLS = [(system, layout) for system in SYSTEM_LAYOUTS for layout in LAYOUTS]


# what each system runs above 1 rank, written out here (not read from the table under test)
RUNS = {"recover": {"shard", "tp", "pp"}, "plain": {"shard", "tp", "pp"}, "torchft": {"shard", "tp"},
        "ckpt-restart": {"shard", "tp"}, "elastic": {"shard", "tp"}}


def _expected_line(system: str, replicas: int, shard: int, tp: int, pp: int) -> str | None:
    dims = {d for d, v in zip(("shard", "tp", "pp"), (shard, tp, pp)) if v > 1}
    own = RUNS.get(system, set())
    if dims <= own:
        return None
    what = "runs one rank per replica" if not own else "runs replicas split by S and TP only"
    who = "recover, plain, torchft, ckpt-restart or elastic" if dims <= RUNS["torchft"] else "recover or plain"
    return f"--system: {system} {what}; {layout_words(replicas, shard, tp, pp)} needs {who}"


def test_the_table_is_the_registry_s_systems_and_says_plain_runs_what_recover_runs():
    assert set(SYSTEM_LAYOUTS) == set(SYSTEMS)
    assert SYSTEM_LAYOUTS["recover"] == SYSTEM_LAYOUTS["plain"] == LAYOUT_DIMENSIONS
    assert SYSTEM_LAYOUTS["torchft"] == ("shard", "tp")  # fault-tolerant HSDP (baselines/torchft_group.py)
    # the restarting baselines: the same grid in each replica, sharded DCP checkpoints
    assert SYSTEM_LAYOUTS["ckpt-restart"] == SYSTEM_LAYOUTS["elastic"] == ("shard", "tp")
    assert all(SYSTEMS[name].layout == SYSTEM_LAYOUTS[name] for name in SYSTEMS)


@pytest.mark.parametrize("replicas, dims, words", [
    (3, (2, 1, 1), "3 x S2"), (2, (1, 2, 2), "2 x TP2 x PP2"), (4, (2, 1, 2), "4 x S2 x PP2"),
    (4, (1, 1, 1), "4 x 1 rank"), (2, (2, 4, 8), "2 x S2 x TP4 x PP8"),
])
def test_layout_words(replicas, dims, words):
    assert layout_words(replicas, *dims) == words


@pytest.mark.parametrize("system, layout", CELLS)
def test_each_system_x_layout_is_run_or_refused_in_one_line_naming_both(system, layout):
    expected = _expected_line(system, 3, *layout)
    assert runs(system, *layout) == (expected is None) == runs_layout(system, ReplicaLayout(*layout))
    refused = refusal(system, 3, *layout)
    assert (None if refused is None else str(refused)) == expected
    if refused is not None:
        assert refused.flag == "--system" and "\n" not in str(refused)
        with pytest.raises(ConfigError) as grid:
            check_layout(system, ReplicaLayout(*layout), 3)
        assert str(grid.value) == expected
    else:
        check_layout(system, ReplicaLayout(*layout), 3)


def test_the_example_lines():
    assert str(refusal("elastic", 3, pp=2)) == ("--system: elastic runs replicas split by S and TP only; 3 x PP2 "
                                                "needs recover or plain")
    for system in ("ckpt-restart", "elastic"):
        assert refusal(system, 3, shard=2) is None and refusal(system, 3, shard=2, tp=2) is None
    assert refusal("torchft", 3, shard=2) is None and refusal("torchft", 3, shard=2, tp=2) is None
    assert str(refusal("torchft", 3, pp=2)) == ("--system: torchft runs replicas split by S and TP only; 3 x PP2 needs "
                                                "recover or plain")


def test_a_system_not_in_the_table_runs_one_rank_per_replica():
    assert runs("somebody", 1, 1, 1) and not runs("somebody", 1, 2, 1)
    assert str(refusal("somebody", 2, pp=2)) == ("--system: somebody runs one rank per replica; 2 x PP2 needs "
                                                 "recover or plain")
    assert str(refusal("somebody", 3, shard=2)) == ("--system: somebody runs one rank per replica; 3 x S2 needs "
                                                    "recover, plain, torchft, ckpt-restart or elastic")


@pytest.mark.parametrize("system, layout", [c for c in CELLS if c[1] != (1, 1, 1)])
def test_recover_train_s_validation_refuses_with_the_table_s_line(system, layout):
    shard, tp, pp = layout
    cfg = TrainConfig(system=system, replicas=2, microbatches=2, shard=shard, tp=tp, pp=pp)
    expected = _expected_line(system, 2, *layout)
    if expected is None:
        cfg.validate(tuple(SYSTEMS))
    else:
        with pytest.raises(ConfigError) as e:
            cfg.validate(tuple(SYSTEMS))
        assert str(e.value) == expected


@pytest.mark.parametrize("system, layout", [(b, lay) for b in BASELINES for lay in [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
                                            if _expected_line(b, 3, *lay) is not None])
def test_bench_recovery_refuses_with_the_table_s_line(system, layout, capsys, monkeypatch):
    import recover.experiments.benches.recovery as bench

    monkeypatch.setattr(bench, "bench_recovery", lambda a: pytest.fail("a run started"))
    shard, tp, pp = layout
    args = Namespace(system=system, kills=1, replicas=3, microbatches=6, seed=0, heartbeat_timeout=3.0,
                     clean_steps=3, repeats=1, out="x", work="", shard=shard, tp=tp, pp=pp, pp_schedule="1f1b")
    assert cmd_bench_recovery(args) == 2
    assert capsys.readouterr().err.strip().endswith(_expected_line(system, 3, *layout))
