"""Token streams and microbatches with global ids.

Contract (the one the whole project's "same data as a failure-free run" rests on):
- iteration t owns microbatch ids t*M .. t*M+M-1 (`iteration_ids`);
- the tokens of microbatch `id` are a pure function of (seed, id, the token
  stream): `MicrobatchSource.get(id)` returns the same tensors on any replica, in
  any process, at any time, so a survivor redoing a dead replica's microbatch
  computes exactly the microbatch that was lost;
- `microbatch_seed(seed, id)` is the seed for any randomness used while computing
  that microbatch (dropout), for the same reason.

Token streams: byte-level text, by default the Python standard library's own
source files read from the running interpreter's installation in sorted order
(real text on every machine, nothing to download); or any text file; or a
pre-tokenized uint16 `.bin` file (nanoGPT's format).
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from recover.core.contract.iteration import iteration_ids  # noqa: F401 (the workload's readers import it here too)

# Skipped so the default corpus is the library itself, not its test suite or
# vendored third-party code.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def _cache_path(root: Path, max_bytes: int) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recover"
    tag = hashlib.sha1(f"{root}|{sys.version}|{max_bytes}".encode()).hexdigest()[:16]
    return base / f"stdlib-corpus-{tag}.u8"


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Up to `max_bytes` bytes of the standard library's .py files, sorted by path.

    Walking ~1,500 files costs ~0.6 s of CPU in every worker process; the result is
    cached (keyed by the library's path, the interpreter's version and the size)
    under ~/.cache/recover and written atomically, so concurrent workers agree.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    cache = _cache_path(root, max_bytes)
    try:
        return np.frombuffer(cache.read_bytes(), dtype=np.uint8)
    except OSError:
        pass
    corpus = _read_stdlib(root, max_bytes)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(corpus.tobytes())
        os.replace(tmp, cache)
    except OSError:  # a read-only home: no cache, same corpus
        pass
    return corpus


def _read_stdlib(root: Path, max_bytes: int) -> np.ndarray:
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    return np.frombuffer(corpus, dtype=np.uint8)


def load_tokens(path: str, max_bytes: int) -> np.ndarray:
    """The token stream: `path` ('' = stdlib corpus); .bin files are uint16 tokens."""
    if not path:
        return stdlib_corpus(max_bytes)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if p.suffix == ".bin":
        return np.memmap(p, dtype=np.uint16, mode="r")
    return np.frombuffer(p.read_bytes(), dtype=np.uint8)


def microbatch_seed(seed: int, mb_id: int) -> int:
    """A 63-bit seed for microbatch `mb_id`'s randomness, independent across ids."""
    return int(np.random.SeedSequence([seed, mb_id]).generate_state(1, dtype=np.uint64)[0] >> 1)


class MicrobatchSource:
    """Microbatch `id` -> (inputs, targets), each (batch_size, block_size) int64."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int):
        if len(tokens) < block_size + 2:
            raise ValueError(
                f"token stream has {len(tokens)} tokens; need more than block_size+1={block_size + 1}"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed

    @property
    def tokens_per_microbatch(self) -> int:
        return self.batch_size * self.block_size

    def get(self, mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, mb_id])
        starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.batch_size)
        rows = np.stack([np.asarray(self.tokens[s : s + self.block_size + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]
