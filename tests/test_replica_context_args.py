"""`ReplicaContext.from_env` names a bad argument before it builds anything.

An explicit 0 (or a negative value) for T, P or a deadline is refused with a ValueError,
where it used to fall back silently to the environment's value (`x or default`): a user who
passes `tp=0` by mistake learns it at once, not from a run with another layout. Pure: the
refusal comes before any store, group or thread exists.
"""
from __future__ import annotations

import pytest

from recover.core import ReplicaContext
from recover.core.contract import env_names


@pytest.fixture
def launched(monkeypatch):
    """What the launcher sets for rank 0 of replica 0 of a replica of 4 ranks (no store is reached)."""
    monkeypatch.setenv(env_names.REPLICA, "0")
    monkeypatch.setenv(env_names.LOCAL_RANK, "0")
    monkeypatch.setenv(env_names.RANKS_PER_REPLICA, "4")
    monkeypatch.setenv(env_names.TP, "2")


@pytest.mark.parametrize("kw, said", [
    ({"tp": 0}, "tp and pp must be >= 1, got tp=0, pp=1"),
    ({"pp": -1}, "tp and pp must be >= 1, got tp=2, pp=-1"),
    ({"collective_timeout": 0}, "collective_timeout must be > 0 seconds, got 0"),
    ({"heartbeat_interval": 0.0}, "heartbeat_interval must be > 0 seconds, got 0.0"),
    ({"heartbeat_timeout": -3}, "heartbeat_timeout must be > 0 seconds, got -3"),
    ({"tp": 3}, "--tp 3 x --pp 1 does not divide the replica's 4 ranks"),
])
def test_a_bad_argument_is_named_before_anything_is_built(launched, kw, said):
    with pytest.raises(ValueError) as e:
        ReplicaContext.from_env(**kw)
    assert str(e.value) == said
