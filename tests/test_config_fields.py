"""Every field of the typed configs carries its one line of doc (core/config/fields.py)."""
from dataclasses import fields

import pytest

from recover.baselines.settings import BaselineConfig
from recover.core.config.train_config import TrainConfig
from recover.experiments.sim.calibration import Calibration, Costs
from recover.experiments.sim.failures import FailureModel
from recover.experiments.sim.model import JobModel
from recover.experiments.sim.scenario_runner import Scenario


@pytest.mark.parametrize("cls", [TrainConfig, BaselineConfig, JobModel, Costs, Calibration, FailureModel, Scenario])
def test_every_field_has_a_doc_line(cls):
    for f in fields(cls):
        doc = f.metadata.get("help", "")
        assert doc.strip() and "\n" not in doc, f"{cls.__name__}.{f.name} has no one-line doc"


def test_extra_metadata_passes_through():
    # `cli=False` is how a TrainConfig field stays off the command line.
    hooks = next(f for f in fields(TrainConfig) if f.name == "hooks")
    assert hooks.metadata["cli"] is False and hooks.metadata["help"]
