"""Shared helpers: run the real CLI in a subprocess, read a run's results; hypothesis profiles.

Hypothesis: with the environment variable CI set (`.ci/run` sets it), the "ci"
profile is loaded: derandomized, so every CI run draws the same examples and a red
CI run is reproducible anywhere with `CI=1`; each test's own max_examples still
applies. Without CI, the "dev" profile keeps searching at random, so local runs go
on finding new counterexamples (which then become @example regression cases).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev")
settings.load_profile("ci" if os.environ.get("CI") else "dev")

sys.path.insert(0, str(Path(__file__).parent))


def run_recover(*args: str, timeout: float = 240, check: bool = False) -> subprocess.CompletedProcess:
    """`recover ARGS...` as a user would run it; a hang fails the test at `timeout`."""
    proc = subprocess.run(
        [sys.executable, "-m", "recover.experiments.cli", *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"recover {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def load_run(out: Path) -> tuple[dict, list[dict], dict]:
    from recover.core.results import read_jsonl

    return (
        json.loads((out / "config.json").read_text()),
        read_jsonl(out / "metrics.jsonl"),
        json.loads((out / "summary.json").read_text()),
    )


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
