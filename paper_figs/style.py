"""One colour per system, the same in every figure (experiment and simulator figures alike).

Contract: systems are named by their labels (experiments.labels: failure-free,
recover, ckpt-restart, torchft, elastic-keep-global, elastic-keep-per-replica, and
the labels of settings variants); `order(labels)` puts them in LABEL_ORDER (unknown
labels last, in the order seen) and `palette(labels)` gives each its colour:
LABEL_ORDER's are fixed, any other gets one of the spare colours, never one in use.
"""
from __future__ import annotations

import seaborn as sns

LABEL_ORDER = ["failure-free", "recover", "ckpt-restart", "torchft", "elastic-keep-global", "elastic-keep-per-replica"]
# Okabe-Ito hues (colour-blind safe), chosen far apart: recover's vermillion is the only
# orange-red; the reference is black; no two systems share a hue family.
PALETTE = dict(zip(LABEL_ORDER, ["#000000", "#D55E00", "#0072B2", "#009E73", "#CC79A7", "#8C564B"]))
_SPARE = ["#E69F00", "#56B4E9", "#F0E442", "#999999"]  # for labels outside LABEL_ORDER


def order(labels) -> list[str]:
    present = list(dict.fromkeys(labels))
    return [x for x in LABEL_ORDER if x in present] + [x for x in present if x not in LABEL_ORDER]


def palette(labels) -> dict:
    extra = [x for x in order(labels) if x not in PALETTE]
    more = dict(zip(extra, _SPARE + sns.color_palette("husl", max(0, len(extra) - len(_SPARE)))))
    return {**PALETTE, **more}
