"""One colour per system, the same in every figure (experiment and simulator figures alike).

Contract: systems are named by their labels (experiments.labels: failure-free,
recover, ckpt-restart, torchft, elastic-keep-global, elastic-keep-per-replica, and
the labels of settings variants such as ckpt-restart-async, torchft-hb5s,
elastic-keep-global-lastcall30s). A variant is its system run with other settings, so
it takes its system's colour and is told apart by a dashed line:
- `base(label)` is the LABEL_ORDER system a label is a variant of (itself for those);
- `order(labels)` puts them in LABEL_ORDER, each variant right after its system,
  unknown labels last, in the order seen;
- `palette(labels)` gives each its colour: its system's (fixed in PALETTE), or for a
  label of no known system one of the spare colours, never one in use;
- `dashes(labels)` (seaborn's style mapping) and `linestyle(label)` (matplotlib's):
  solid for a system at its defaults, dashed for a variant.
"""
from __future__ import annotations

import seaborn as sns

LABEL_ORDER = ["failure-free", "recover", "ckpt-restart", "torchft", "elastic-keep-global", "elastic-keep-per-replica"]
# Okabe-Ito hues (colour-blind safe), chosen far apart: recover's vermillion is the only
# orange-red; the reference is black; no two systems share a hue family.
PALETTE = dict(zip(LABEL_ORDER, ["#000000", "#D55E00", "#0072B2", "#009E73", "#CC79A7", "#8C564B"]))
_SPARE = ["#E69F00", "#56B4E9", "#F0E442", "#999999"]  # for labels of no known system
VARIANT_DASHES = (4, 2)
"""How a variant's line is drawn (seaborn dash spec; matplotlib: "--")."""


def base(label: str) -> str | None:
    """The system `label` names, or is a settings variant of (`system-tag...`); None if none."""
    hits = [b for b in LABEL_ORDER if label == b or label.startswith(b + "-")]
    return max(hits, key=len) if hits else None


def order(labels) -> list[str]:
    present = list(dict.fromkeys(labels))
    known = [x for x in present if base(x) is not None]
    known.sort(key=lambda x: (LABEL_ORDER.index(base(x)), x != base(x), x))
    return known + [x for x in present if base(x) is None]


def palette(labels) -> dict:
    labels = list(labels)
    out = {x: PALETTE[base(x)] for x in labels if base(x) is not None}
    extra = [x for x in order(labels) if base(x) is None]
    more = dict(zip(extra, _SPARE + sns.color_palette("husl", max(0, len(extra) - len(_SPARE)))))
    return {**PALETTE, **out, **more}


def dashes(labels) -> dict:
    return {x: (VARIANT_DASHES if base(x) not in (None, x) else "") for x in labels}


def linestyle(label: str) -> str:
    return "--" if base(label) not in (None, label) else "-"
