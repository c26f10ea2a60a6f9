"""One colour per system in every figure (paper_figs/style.py): a settings variant takes its system's
colour, dashed; no two systems share a colour, whatever other labels a figure shows."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "paper_figs"))

from style import LABEL_ORDER, PALETTE, base, dashes, linestyle, order, palette  # noqa: E402

from recover.experiments.sim.system_policies import SYSTEMS  # noqa: E402


def test_every_simulated_variant_takes_its_systems_colour_dashed():
    sim = list(SYSTEMS)
    pal = palette(sim)
    for label in sim:
        b = base(label)
        assert b in LABEL_ORDER, label
        assert pal[label] == PALETTE[b]
        assert (linestyle(label) == "-") == (label == b) and (dashes([label])[label] == "") == (label == b)
    assert base("elastic-keep-global-lastcall30s") == "elastic-keep-global"
    assert base("ckpt-restart-async") == "ckpt-restart"


def test_a_systems_colour_does_not_depend_on_the_figure():
    alone = palette(["recover", "torchft"])
    crowded = palette(list(SYSTEMS) + ["failure-free", "something-new"])
    assert alone["recover"] == crowded["recover"] and alone["torchft"] == crowded["torchft"]
    systems = [x for x in crowded if base(x) == x or base(x) is None]
    assert len({crowded[x] for x in systems}) == len(systems)  # distinct systems, distinct colours
    assert order(["torchft-hb5s", "recover", "torchft", "x"]) == ["recover", "torchft", "torchft-hb5s", "x"]
