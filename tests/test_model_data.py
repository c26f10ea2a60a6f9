"""The workload's building blocks: model shapes, global-id microbatches, corpora."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.config.train_config import TrainConfig
from recover.core.components.data import (
    MicrobatchSource, _read_stdlib, iteration_ids, load_tokens, microbatch_seed, stdlib_corpus,
)
from recover.core.components.model import GPT, MODEL_CONFIGS, model_config
from recover.core.training.workload import Workload


def test_named_configs_build_and_gpt2_shape():
    assert {"tiny", "gpt2-124m"} <= set(MODEL_CONFIGS)
    g = MODEL_CONFIGS["gpt2-124m"]
    assert (g.n_layer, g.n_head, g.n_embd, g.block_size) == (12, 12, 768, 1024)
    with pytest.raises(KeyError, match="unknown model"):
        model_config("huge")


def test_tiny_forward_loss_is_near_uniform_at_init():
    torch.manual_seed(0)
    model = GPT(MODEL_CONFIGS["tiny"])
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 256)
    # A fresh model predicts roughly uniformly: cross-entropy close to ln(256).
    assert abs(loss.item() - np.log(256)) < 0.5


def test_same_seed_same_weights():
    a, b = Workload(TrainConfig(seed=3)), Workload(TrainConfig(seed=3))
    c = Workload(TrainConfig(seed=4))
    assert a.state_checksum() == b.state_checksum() != c.state_checksum()


def test_iteration_ids():
    assert iteration_ids(0, 4) == [0, 1, 2, 3]
    assert iteration_ids(3, 8) == list(range(24, 32))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), mb=st.integers(0, 10**9))
def test_microbatch_is_a_pure_function_of_seed_and_id(seed, mb):
    tokens = np.arange(5000, dtype=np.uint8)
    a = MicrobatchSource(tokens, 2, 16, seed).get(mb)
    b = MicrobatchSource(tokens.copy(), 2, 16, seed).get(mb)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one
    assert microbatch_seed(seed, mb) == microbatch_seed(seed, mb)


def test_different_ids_give_different_data():
    src = MicrobatchSource(stdlib_corpus(200_000), 4, 32, 0)
    assert not torch.equal(src.get(0)[0], src.get(1)[0])


def test_stdlib_corpus_is_deterministic_real_text(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a, b = stdlib_corpus(100_000), stdlib_corpus(100_000)  # the second one comes from the cache
    assert len(list(tmp_path.rglob("stdlib-corpus-*"))) == 1
    assert len(a) == 100_000 and np.array_equal(a, b)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert np.array_equal(b, _read_stdlib(root, 100_000))  # the cache holds exactly the files' bytes
    assert b"def " in a.tobytes() and b"import" in a.tobytes()


def test_text_and_bin_files(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_bytes(b"hello world " * 100)
    assert load_tokens(str(txt), 0)[:5].tobytes() == b"hello"
    binf = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(binf)
    toks = load_tokens(str(binf), 0)
    assert toks.dtype == np.uint16 and toks[999] == 999
    with pytest.raises(FileNotFoundError):
        load_tokens(str(tmp_path / "missing.txt"), 0)


def test_bin_tokens_beyond_vocab_are_refused(tmp_path):
    binf = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(binf)
    with pytest.raises(ValueError, match="--vocab-size"):
        Workload(TrainConfig(data=str(binf)))
    w = Workload(TrainConfig(data=str(binf), vocab_size=1000))
    assert w.fold(0) > 0


def test_fold_keeps_ledger_and_pack_is_a_copy():
    w = Workload(TrainConfig())
    w.fold(5)
    w.fold(9)
    assert w.ledger == [5, 9]
    buf = w.pack()
    buf.add_(1.0)  # a reduction writing into the buffer never reaches the accumulator
    assert not torch.equal(buf, w.accumulator)
    assert w.accumulator[-1].item() > 0  # the loss sum rides in the last slot
