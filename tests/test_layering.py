"""The folders import one way, checked by import-linter (contracts in pyproject.toml).

experiments -> baselines | fault_injection -> core; core imports none of them, the two
middle folders not each other, and no folder holds an import circle. Inside core/, the
planes import downwards only (training, parallel, then coordinator | worker | components,
launch, config, storage, contract), so the coordinator and the worker never import each
other. The first test runs
`lint-imports` on the tree as it is; the others copy the tree, break one rule in the copy
and show that `lint-imports` then fails, naming the import that broke it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "baselines", "fault_injection", "experiments")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        # Ahead of the editable install's finder: `recover.*` now resolves to the copy.
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_the_layering():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout, proc.stdout


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The four folders as a plain `recover/` package tree, with the same contracts."""
    for d in FOLDERS:
        shutil.copytree(ROOT / d, tmp_path / "recover" / d, ignore=shutil.ignore_patterns("__pycache__"))
    text = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text[text.index("\n[tool.importlinter]\n"):])
    return tmp_path


@pytest.mark.parametrize("module, line, expected", [
    ("core/config/fields.py", "import recover.experiments", "recover.core is not allowed to import recover.experiments"),
    ("core/config/fields.py", "import recover.baselines", "recover.core is not allowed to import recover.baselines"),
    ("core/config/fields.py", "import recover.fault_injection",
     "recover.core is not allowed to import recover.fault_injection"),
    ("baselines/settings.py", "import recover.experiments",
     "recover.baselines is not allowed to import recover.experiments"),
    ("baselines/settings.py", "import recover.fault_injection",
     "recover.baselines is not allowed to import recover.fault_injection"),
    # Circles: storage's results import contract's idranges; the CLI imports the commands, which import run.
    ("core/contract/idranges.py", "from recover.core.storage import results", "No cycles are allowed in recover.core"),
    # core/'s planes: the coordinator and the worker never import each other; contract imports no plane.
    ("core/coordinator/protocol.py", "import recover.core.worker.replica",
     "recover.core.coordinator is not allowed to import recover.core.worker"),
    ("core/worker/comm.py", "import recover.core.coordinator.vote_tally",
     "recover.core.worker is not allowed to import recover.core.coordinator"),
    ("core/contract/wire.py", "import recover.core.config.train_config",
     "recover.core.contract is not allowed to import recover.core.config"),
    ("experiments/run.py", "from recover.experiments import cli", "No cycles are allowed in recover.experiments"),
])
def test_a_broken_rule_fails_the_check(tree_copy: Path, module: str, line: str, expected: str):
    assert _lint(tree_copy, pythonpath=tree_copy).returncode == 0  # the copy alone is clean
    with open(tree_copy / "recover" / module, "a") as f:
        f.write(f"\n{line}  # injected by the test\n")
    proc = _lint(tree_copy, pythonpath=tree_copy)
    assert proc.returncode != 0, proc.stdout
    assert expected in proc.stdout, proc.stdout
