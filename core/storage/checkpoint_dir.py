"""Where checkpoints live, and which of them are complete (no torch: the CLI reads it).

Contract:
- A checkpoint root ROOT holds complete checkpoints, ROOT/step-<s:08d>, each with
  DCP's .metadata (written last by a save), and the temporary directories of saves
  in progress or killed midway, ROOT/.tmp-step-<s:08d>. Only a directory that was
  renamed into the step-<s> name *and* holds .metadata counts as complete; nothing
  else is ever loaded (`core/training/checkpoint.py` writes this way, for every system).
- A checkpoint of step s holds the state before iteration s: a run resumed from it
  starts at step s.
- `remove_temps` and `prune` delete; call them only where no save can be running
  (a resume before anything starts, or the writer itself after its own rename).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_COMPLETE = re.compile(r"^step-(\d{8})$")


class CheckpointDir:
    """The checkpoint root: complete checkpoints and in-progress temp dirs."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def tmp_path(self, step: int) -> Path:
        return self.root / f".tmp-step-{step:08d}"

    @staticmethod
    def step_of(path: str | os.PathLike) -> int:
        """The step a complete checkpoint's directory name says (ValueError if it is not one)."""
        m = _COMPLETE.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path} is not a checkpoint directory (step-NNNNNNNN)")
        return int(m.group(1))

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending (a renamed dir with DCP metadata)."""
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            m = _COMPLETE.match(p.name)
            if m and (p / ".metadata").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def remove_temps(self) -> None:
        """Delete leftovers of killed saves (only when no save can be running)."""
        if self.root.is_dir():
            for p in self.root.glob(".tmp-step-*"):
                shutil.rmtree(p, ignore_errors=True)

    def remove_all(self) -> None:
        """Delete every checkpoint and temp dir (a fresh run into a root it owns)."""
        if self.root.is_dir():
            for p in list(self.root.glob("step-*")) + list(self.root.glob(".tmp-step-*")):
                shutil.rmtree(p, ignore_errors=True)

    def prune(self, keep: int) -> None:
        for step in self.complete_steps()[:-keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)
