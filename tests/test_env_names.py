"""Every RECOVER_* environment name is spelled once, in core/contract/env_names.py.

A reader and a writer of one variable that spell it apart fail silently (the reader takes
its default). The source is read: a string constant that is exactly a RECOVER_* name, in
the project's code outside env_names.py, fails here. Pure: file reads.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from recover.core.contract import env_names

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"RECOVER_[A-Z0-9_]+")


def test_no_environment_name_is_spelled_outside_its_module():
    spelled = []
    for pkg in ("core", "baselines", "experiments", "fault_injection", "examples"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "env_names.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not spelled, "use core.contract.env_names:\n" + "\n".join(spelled)


def test_no_test_spells_a_run_environment_name():
    """The tests read and set the run's names through env_names too (a test that spelled one apart
    would set a variable no process reads, and pass for the wrong reason). The suite's own knobs
    (RECOVER_FAST, RECOVER_SLOW, RECOVER_TEST_*) are not the run's and are not in env_names; a
    worker script held in a string is a user's loop, which spells the name as a user would."""
    run_names = {v for k, v in vars(env_names).items() if k.isupper()}
    spelled = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in run_names:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not spelled, "use core.contract.env_names:\n" + "\n".join(spelled)


def test_each_name_is_its_constant_with_the_prefix():
    names = {k: v for k, v in vars(env_names).items() if k.isupper()}
    assert names and all(v == f"RECOVER_{k}" for k, v in names.items()), names
