"""One concept, one flag, across systems.

recover and the checkpointing baselines mean the same thing by a checkpoint interval,
the checkpoints kept, and a replacement's delay: they take the same flags
(--checkpoint-every, --checkpoint-keep, --replace-after), and the baselines' async save is
--checkpoint-async. The old flags (--ckpt-every, --ckpt-keep, --ckpt-async,
--replace-wait) still parse, hidden from --help, so scripts keep working. Pure: the parser.
"""
from __future__ import annotations

import pytest

from recover.baselines.settings import BaselineConfig
from recover.core.config.train_config import ConfigError, TrainConfig, dataclass_from_args
from recover.experiments.cli import build_parser
from recover.experiments.systems import SYSTEMS


def _parsed(*flags: str) -> tuple[TrainConfig, BaselineConfig]:
    args = build_parser().parse_args(["train", "--out", "/tmp/x", *flags])
    return dataclass_from_args(TrainConfig, args), dataclass_from_args(BaselineConfig, args)


def test_the_shared_flags_set_the_baselines_settings():
    cfg, settings = _parsed("--system", "ckpt-restart", "--checkpoint-every", "3", "--checkpoint-keep", "4",
                            "--replace-after", "1.5", "--restart-mode", "replace", "--checkpoint-async")
    assert (settings.ckpt_every, settings.ckpt_keep, settings.replace_wait, settings.ckpt_async) == (3, 4, 1.5, True)
    cfg.validate(tuple(SYSTEMS))
    settings.validate(cfg)
    # and recover's own fields, from the same flags
    cfg, _ = _parsed("--system", "recover", "--checkpoint-every", "3", "--checkpoint-keep", "4")
    assert (cfg.checkpoint_every, cfg.checkpoint_keep) == (3, 4)


def test_the_old_flags_still_parse_to_the_same_settings():
    _, old = _parsed("--system", "ckpt-restart", "--ckpt-every", "3", "--ckpt-keep", "4", "--replace-wait", "1.5",
                     "--ckpt-async")
    _, new = _parsed("--system", "ckpt-restart", "--checkpoint-every", "3", "--checkpoint-keep", "4",
                     "--replace-after", "1.5", "--checkpoint-async")
    assert old == new


def test_help_names_each_concept_once():
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for old in ("--ckpt-every", "--ckpt-keep", "--ckpt-async", "--replace-wait"):
        assert old not in text
    for new in ("--checkpoint-every", "--checkpoint-keep", "--checkpoint-async", "--replace-after"):
        assert text.count(new + " ") + text.count(new + "\n") >= 1, new


def test_a_system_that_does_not_take_the_concept_says_so():
    cfg, _ = _parsed("--system", "torchft", "--checkpoint-every", "3")
    with pytest.raises(ConfigError, match="torchft writes no checkpoints"):
        cfg.validate(tuple(SYSTEMS))
    cfg, _ = _parsed("--system", "elastic", "--replace-after", "2")
    with pytest.raises(ConfigError, match="only recover and ckpt-restart"):
        cfg.validate(tuple(SYSTEMS))
    _, settings = _parsed("--system", "ckpt-restart", "--checkpoint-every", "0")
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        settings.validate(TrainConfig(system="ckpt-restart", out="/tmp/x"))
