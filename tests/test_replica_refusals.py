"""The public API refuses to commit a wrong gradient.

- A `.grad` detached from the accumulator (a user's `optimizer.zero_grad()`, whose
  default is set_to_none, or a DDP wrapper's buckets) is caught by `fold()` and
  `commit()`, with an error that names the cause; nothing wrong is committed.
- A `fold()` refused for an id outside the quota leaves no gradient behind: the
  committed update is exactly the failure-free one.
- Replicas whose initial weights differ never form generation 0: the run stops
  with an error naming the replica (the state machine, and one real 2-process run).

The Replica tests run one real replica in this process: the coordinator's real
membership service in a thread, its real store, a one-rank gloo group.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import run_recover

from recover.core.config.train_config import TrainConfig
from recover.core.coordinator.process import host_store
from recover.core.components.data import iteration_ids
from recover.core.coordinator.service import CoordinatorService
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.worker.replica import Replica
from recover.core.storage.results import read_jsonl, read_metrics

M = 2  # microbatches of the one step


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def loss_of(model: torch.nn.Module, mb_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(5, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))


def failure_free_weights() -> list[torch.Tensor]:
    """One SGD step (lr 1) on the mean gradient of step 0's M microbatches, without any Replica."""
    model = make_model()
    for mb in iteration_ids(0, M):
        (loss_of(model, mb) / M).backward()
    with torch.no_grad():
        return [p - p.grad for p in model.parameters()]


@pytest.fixture
def solo(tmp_path):
    """A factory for this process's one replica of a 1-replica, 1-step run."""
    cfg = TrainConfig(system="recover", replicas=1, microbatches=M, steps=1, out=str(tmp_path / "run"))
    store = host_store("127.0.0.1")
    stop = threading.Event()
    service = CoordinatorService(cfg, "127.0.0.1", 0, stop)
    served: dict = {}
    thread = threading.Thread(target=lambda: served.setdefault("code", service.serve()), daemon=True)
    thread.start()
    made: list[Replica] = []

    def make(model: torch.nn.Module) -> Replica:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        replica = Replica(model.parameters(), opt, replica=0, control_addr=("127.0.0.1", service.port),
                          store_addr=("127.0.0.1", store.port), collective_timeout=20.0,
                          join_token=service.join_token)
        made.append(replica)
        return replica

    yield make
    for r in made:
        r.close()
    stop.set()
    thread.join(10)
    del store


def fold_all(replica: Replica, model: torch.nn.Module) -> None:
    for mb in replica.quota():
        loss = loss_of(model, mb)
        loss.backward()
        replica.fold(mb, loss.item())


def assert_committed_failure_free(model: torch.nn.Module) -> None:
    for p, want in zip(model.parameters(), failure_free_weights()):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_zero_grad_before_a_backward_is_refused_by_fold_and_nothing_wrong_is_committed(solo):
    model = make_model()
    replica = solo(model)
    first, second = list(replica.quota())
    loss = loss_of(model, first)
    loss.backward()
    replica.fold(first, loss.item())
    replica.optimizer.zero_grad()  # torch's default: set_to_none, .grad detached from the accumulator
    loss = loss_of(model, second)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\)"):
        replica.fold(second, loss.item())
    assert list(replica.quota()) == [first, second]  # both are owed again
    fold_all(replica, model)
    assert replica.commit()
    assert_committed_failure_free(model)


def test_a_grad_replaced_after_the_last_fold_is_refused_by_commit(solo):
    model = make_model()
    replica = solo(model)
    fold_all(replica, model)
    replica.optimizer.zero_grad()  # after the folds: the accumulator holds them, .grad does not view it
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"commit\(\).*no longer views.*zero_grad\(\)"):
        replica.commit()
    for p, b in zip(model.parameters(), before):  # no optimizer step was taken
        assert torch.equal(p.detach(), b)
    fold_all(replica, model)  # the folds were discarded: redo them, then the step is exact
    assert replica.commit()
    assert_committed_failure_free(model)


def test_a_fold_refused_for_an_id_outside_the_quota_leaves_no_gradient_behind(solo):
    model = make_model()
    replica = solo(model)
    first, _ = list(replica.quota())
    loss = loss_of(model, first)
    loss.backward()
    replica.fold(first, loss.item())
    stray = iteration_ids(1, M)[0]  # next step's id: its backward runs, its fold is refused
    loss_of(model, stray).backward()
    with pytest.raises(ValueError, match="not in this replica's quota"):
        replica.fold(stray, 0.0)
    fold_all(replica, model)
    assert sorted(replica.ledger) == iteration_ids(0, M)
    assert replica.commit()
    assert_committed_failure_free(model)


def test_generation_0_does_not_form_when_initial_weights_differ():
    proto = ProtocolStateMachine(3, 3, 1, join_timeout=30.0, now=0.0)
    out = []
    for r, digest in enumerate(["aa" * 32, "bb" * 32, "aa" * 32]):
        out += proto.on_hello(r, {"tokens_per_mb": 1, "weights_sha256": digest}, 0.0)
    assert not [a for a in out if a.kind == "send" and a.msg["t"] == "gen"]
    finish = [a for a in out if a.kind == "finish"]
    assert finish and finish[0].code != 0
    assert "replica(s) [1] do not match replica(s) [0, 2]" in finish[0].reason
    stops = [a for a in out if a.kind == "send" and a.msg["t"] == "stop"]
    assert sorted(a.replica for a in stops) == [0, 1, 2] and "initial weights differ" in stops[0].msg["reason"]


SEEDED_BY_REPLICA = '''
import os, torch
from recover.core import Replica
torch.manual_seed(int(os.environ["RECOVER_REPLICA"]))  # the bug: each replica its own weights
model = torch.nn.Linear(4, 1)
replica = Replica.from_env(model, torch.optim.SGD(model.parameters(), lr=0.1))
while not replica.done:
    for mb in replica.quota():
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        replica.fold(mb, loss.item())
    replica.commit()
'''


@pytest.mark.procs
def test_a_run_whose_replicas_start_from_different_weights_stops_naming_the_replica(tmp_path):
    script = tmp_path / "seeded_by_replica.py"
    script.write_text(SEEDED_BY_REPLICA)
    out = tmp_path / "run"
    proc = run_recover("launch", "--replicas", "2", "--microbatches", "2", "--steps", "3", "--out", str(out),
                       "--", sys.executable, str(script), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert read_metrics(out / "metrics.jsonl") == []  # nothing was committed
    end = read_jsonl(out / "events.jsonl")[-1]
    assert end["kind"] == "run_end" and "initial weights differ: replica(s) [1] do not match replica(s) [0]" \
        in end["reason"], end
    assert "initial weights differ" in proc.stdout
    logs = [Path(out / "logs" / f"replica{r}.log").read_text() for r in (0, 1)]
    assert all("initial weights differ" in text for text in logs), logs
