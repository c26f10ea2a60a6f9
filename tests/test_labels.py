"""One vocabulary for systems: every place that names a system uses experiments.labels."""
from __future__ import annotations

import dataclasses

from recover.baselines.settings import BaselineConfig
from recover.core.config.train_config import TrainConfig
from recover.experiments import aggregate
from recover.experiments.grids import FAILURE_FREE, FAULTY_SYSTEMS, build_grid
from recover.experiments.labels import VARIANT_SETTINGS, variant_label
from recover.experiments.sim.system_policies import SYSTEMS as SIM_SYSTEMS
from recover.experiments.systems import SYSTEMS


def test_label_defaults_are_the_baselines_defaults():
    defaults = {"baseline": {f.name: f.default for f in dataclasses.fields(BaselineConfig)},
                "train": {f.name: f.default for f in dataclasses.fields(TrainConfig)}}
    for v in VARIANT_SETTINGS:
        assert v.system in SYSTEMS
        assert defaults[v.section][v.name] == v.default, v.name


def test_a_train_section_setting_labels_a_run_from_its_config():
    cfg = {"train": {"system": "recover", "heartbeat_timeout": 10.0}}
    assert aggregate._label_of(cfg) == "recover-hb10s"
    assert aggregate._label_of({"train": {"system": "recover", "heartbeat_timeout": 3.0}}) == "recover"
    grid = build_grid("recovery", seeds=[0])
    hb = [r for r in grid.runs if r.label == "recover-hb10s"]
    assert hb and all(r.overrides["heartbeat_timeout"] == r.overrides["collective_timeout"] == 10.0 for r in hb)
    assert {r.plan["faults"][0]["kind"] for r in hb} == {"hang"}


def test_labels_are_system_names_plus_settings():
    assert variant_label("plain") == "failure-free"
    assert variant_label("ckpt-restart", {"restart_mode": "survivors"}) == "ckpt-restart"
    assert variant_label("elastic") == "elastic-keep-global"
    assert variant_label("elastic", {"elastic_batch": "keep-per-replica"}) == "elastic-keep-per-replica"
    assert variant_label("elastic", BaselineConfig().to_dict()) == "elastic-keep-global"


def test_grids_aggregation_and_simulator_share_the_labels():
    for v in (FAILURE_FREE, *FAULTY_SYSTEMS):
        assert v.label == variant_label(v.system, dict(v.settings))
    grid = build_grid("trajectory", seeds=[0])
    for run in grid.runs:
        cfg = {"train": {"system": run.system, **run.overrides}, "baseline": run.settings}
        assert aggregate._label_of(cfg) == run.label
    faulty = {v.label for v in FAULTY_SYSTEMS}
    for label, (_, system, settings) in SIM_SYSTEMS.items():
        assert system in SYSTEMS and label == variant_label(system, settings)
        # Every simulated system is one the experiments run for real, or (the cluster-scale
        # variants) one of them with only its timeout or checkpoint-save settings changed.
        timeouts = {"rdzv_last_call_timeout", "torchft_heartbeat_timeout_ms", "ckpt_async"}
        real = variant_label(system, {k: v for k, v in settings.items() if k not in timeouts})
        assert label in faulty or (real in faulty and set(settings) & timeouts), label
