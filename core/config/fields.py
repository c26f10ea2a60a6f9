"""The documented dataclass field every typed config in the project uses.

Contract:
- `doc_field(default, help, **meta)` is `dataclasses.field(default=default)` whose
  metadata carries `help` (the field's one line of doc) and any extra keys (e.g.
  `cli=False` keeps a `TrainConfig` field off the command line).
- Readers of the doc (`add_dataclass_flags`, the simulator's calibration table)
  look it up as `field.metadata["help"]`; this is the one place that key is written.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any


def doc_field(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with `default` and its one-line doc `help` in its metadata."""
    return field(default=default, metadata={"help": help, **meta})
