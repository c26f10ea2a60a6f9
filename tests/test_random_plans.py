"""Random fault plans at replicas of many ranks: drawn layouts, faults at drawn ranks and phases.

Each case is drawn from its seed alone (`draw_case`, `random.Random(seed)`): a layout
among 3 x S2, 2 x TP2, 2 x PP2 and 2 x (PP2 x S2), and one fault for each of the
replicas that may go (every replica but one, at most two), each of a drawn kind at a
drawn rank, step and phase:
- crash: the rank SIGKILLs itself (its own PID);
- hang: the rank SIGSTOPs itself, for good; only its silence to its leader tells;
- stall: the rank's training thread blocks for good, its heartbeats and its beats to
  its leader going on; only the replica's stalled progress tells.

Whatever was drawn, the run keeps the invariant, by what the workers reported: every
step committed once, each with exactly the failure-free ids (the members' own ledgers),
the loss of the same layout's failure-free run (`plain`, which builds the same grid) to
1e-5 relative, every planned fault fired (by the rank that was named), and the replicas
struck gone from the members from then on while the others stay.

`make test` runs DEFAULT_SEEDS. RECOVER_PLAN_SEEDS="3 17 42" runs other seeds: a case
that fails names its seed and plan, so it reproduces with that one seed.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import reported_ids

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

STEPS = 5
# (replicas, shard, tp, pp): the layouts the mission runs at, each at the smallest size
# where a replica has two ranks along that dimension
LAYOUTS = [(3, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 1, 2)]
KINDS = ("crash", "hang", "stall")
PHASES = ("forward", "backward", "allreduce", "vote", "commit", "optimizer_step")
DEFAULT_SEEDS = (0, 1)
# short deadlines, so a frozen or stalled rank costs seconds: a hang is seen by its leader's
# missing beats (--heartbeat-timeout), a stall by the replica's lack of progress measured
# against the collective timeout
DEADLINES = ["--heartbeat-timeout", "2", "--collective-timeout", "2"]


@dataclass(frozen=True)
class Case:
    seed: int
    replicas: int
    shard: int
    tp: int
    pp: int
    faults: tuple[dict, ...]

    @property
    def microbatches(self) -> int:
        return 2 * self.replicas

    def layout_args(self) -> list[str]:
        return ["--replicas", str(self.replicas), "--microbatches", str(self.microbatches), "--steps", str(STEPS),
                "--shard", str(self.shard), "--tp", str(self.tp), "--pp", str(self.pp)]

    def struck(self) -> dict[int, int]:
        """replica -> the step its fault fires at."""
        return {f["replica"]: f["step"] for f in self.faults}


def draw_case(seed: int) -> Case:
    """The case of `seed`: a pure function of it (one Random, drawn in a fixed order)."""
    rng = random.Random(seed)
    replicas, shard, tp, pp = rng.choice(LAYOUTS)
    ranks = shard * tp * pp
    struck = rng.sample(range(replicas), rng.randint(1, min(2, replicas - 1)))
    faults = []
    for r in sorted(struck):
        fault = {"kind": rng.choice(KINDS), "replica": r, "rank": rng.randrange(ranks),
                 "step": rng.randint(1, STEPS - 2), "phase": rng.choice(PHASES)}
        if fault["phase"] in ("forward", "backward"):
            fault["microbatch"] = 0
        faults.append(fault)
    return Case(seed, replicas, shard, tp, pp, tuple(faults))


def test_cases_are_drawn_from_the_seed_alone_and_cover_every_layout():
    assert draw_case(7) == draw_case(7)
    cases = [draw_case(s) for s in range(40)]
    assert {(c.replicas, c.shard, c.tp, c.pp) for c in cases} == set(LAYOUTS)
    assert {f["kind"] for c in cases for f in c.faults} == set(KINDS)
    assert {f["phase"] for c in cases for f in c.faults} == set(PHASES)
    for c in cases:
        assert 1 <= len(c.faults) < c.replicas  # a survivor, always
        assert all(0 <= f["rank"] < c.shard * c.tp * c.pp and 1 <= f["step"] <= STEPS - 2 for f in c.faults)
    # the ranks struck are not only leaders
    assert any(f["rank"] > 0 for c in cases for f in c.faults)


def _seeds() -> list[int]:
    given = os.environ.get("RECOVER_PLAN_SEEDS", "").split()
    return [int(s) for s in given] if given else list(DEFAULT_SEEDS)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The failure-free losses of each layout (plain at that layout), made once per layout."""
    made: dict[tuple, list[float]] = {}

    def losses(case: Case) -> list[float]:
        key = (case.replicas, case.shard, case.tp, case.pp)
        if key not in made:
            out = tmp_path_factory.mktemp("plain")
            run_recover("train", "--system", "plain", *case.layout_args(), "--out", str(out), "--no-progress",
                        check=True, timeout=200)
            made[key] = [m["loss"] for m in load_run(out)[1]]
        return made[key]

    return losses


@pytest.mark.parametrize("seed", _seeds())
def test_a_drawn_plan_keeps_the_ids_and_the_trajectory(seed, tmp_path, references):
    case = draw_case(seed)
    said = f"seed {seed}: {case}"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": list(case.faults)}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *case.layout_args(), *DEADLINES, "--faults", str(plan),
                       "--out", str(out), "--no-progress", timeout=240)
    assert proc.returncode == 0, f"{said}\n{proc.stderr[-3000:]}"
    fired = assert_every_planned_fault_fired(out)
    pids = json.loads((out / "pids.json").read_text())["replicas"]
    for f, planned in zip(fired, case.faults):  # fired by the rank named, by its own PID
        assert f["pid"] == pids[str(planned["replica"])][planned["rank"]], (said, f)
    _, metrics, _ = load_run(out)
    assert [m["step"] for m in metrics] == list(range(STEPS)), said
    for m in metrics:
        assert reported_ids(m) == iteration_ids(m["step"], case.microbatches), (said, m)
        live = [r for r in range(case.replicas) if case.struck().get(r, STEPS) > m["step"]]
        # a replica struck at step t may still commit t (a fault after its vote); never after t
        assert set(live) <= set(m["members"]), (said, m)
        assert all(r in live or case.struck()[r] == m["step"] for r in m["members"]), (said, m)
    assert metrics[-1]["members"] == [r for r in range(case.replicas) if r not in case.struck()], said
    assert [m["loss"] for m in metrics] == pytest.approx(references(case), rel=1e-5), said
