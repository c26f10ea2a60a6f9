"""The control port is not an open door.

A live coordinator, in the middle of a real 2-replica run, is sent random bytes
and well-formed-but-wrong messages (hypothesis-chosen) on connections of its own:
hellos with a wrong join token (some claiming to be replica 0 or 1), votes and
joins before any hello, unknown and ill-typed messages, non-objects, an oversized
line and a flood of garbage. The run completes with the failure-free trajectory
(computed here, in-process, from the same model and data), no member is
disturbed, every attacking connection is closed, and events.jsonl names each
attacking peer and what it refused.
"""
from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics
from recover.core.contract.wire import MAX_LINE_BYTES, MAX_REFUSALS, _join_ok, _table_problem, _vote_ok, parse_line

R, M, S, PAUSE_AT = 2, 4, 6, 2

WORKER = f'''
import os, sys, time
from pathlib import Path
import pytest
import torch


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(mb_id):
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


if __name__ == "__main__":
    from recover.core import Replica
    out = Path(sys.argv[1])
    model, optimizer = build()
    replica = Replica.from_env(model, optimizer)
    if os.environ["RECOVER_REPLICA"] == "0":  # tell the test where the control port is (not the token)
        (out / "control_addr.tmp").write_text(os.environ["RECOVER_CONTROL_ADDR"])
        (out / "control_addr.tmp").rename(out / "control_addr")
    while not replica.done:
        deadline = time.monotonic() + 120
        while replica.step == {PAUSE_AT} and not (out / "attack_done").exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # the attack happens here, between steps, with the run live
        for mb in replica.quota():
            x, y = batch(mb)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            replica.fold(mb, loss.item())
        replica.commit()
    replica.close()
'''


def failure_free_losses(script: Path) -> list[float]:
    spec = importlib.util.spec_from_file_location("control_port_worker", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, optimizer = mod.build()
    losses = []
    for step in range(S):
        total = 0.0
        for mb in iteration_ids(step, M):
            x, y = mod.batch(mb)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / M).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / M)
    return losses


wrong_messages = st.one_of(
    st.fixed_dictionaries({"t": st.just("hello"), "replica": st.integers(-2, R + 1), "token": st.text(max_size=40)}),
    st.fixed_dictionaries({"t": st.sampled_from(["vote", "join", "fail"]), "gen": st.integers(-1, 3),
                           "step": st.integers(-1, S), "ok": st.booleans(),
                           "ledger": st.lists(st.one_of(  # id ranges, as the wire carries them, or plain ids
                               st.tuples(st.integers(0, M * S), st.integers(0, M * S)).map(list),
                               st.integers(0, M * S)), max_size=6)}),
    st.fixed_dictionaries({"t": st.one_of(st.text(max_size=8), st.integers(), st.none())}),
    st.dictionaries(st.text(max_size=6), st.one_of(st.none(), st.integers(), st.text(max_size=6), st.booleans()),
                    max_size=4),
    st.lists(st.integers(), max_size=3),
)
lines = st.lists(st.one_of(wrong_messages.map(lambda m: json.dumps(m).encode()), st.binary(max_size=120)),
                 min_size=1, max_size=12)
WRONG_HELLO = json.dumps({"t": "hello", "replica": 0, "token": "not-the-token"}).encode()


def closed_by_peer(sock: socket.socket, timeout: float = 20.0) -> bool:
    """True once the coordinator has closed `sock` (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def attack(addr: tuple[str, int], payload: bytes) -> str:
    """Send `payload` on a connection of its own; return its peer name as the coordinator sees it."""
    with socket.create_connection(addr, timeout=10) as sock:
        host, port = sock.getsockname()[:2]
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed already, mid-payload: that is the point
        assert closed_by_peer(sock), f"the coordinator kept the connection of {host}:{port} open"
    return f"{host}:{port}"


# JSON values a field could hold: each kind, and ledgers of the right and of nearly the right shape
_samples = [None, True, False, 0, -3, 10**6, 0.5, "", "ab", [[0, 8]], [[5, 3]], [[4, 4]], [[0, 1], [4, 6]],
            [[0.0, 8]], [[True, 8]], [0, 8], [], [[0, 8, 9]], [[0, 8], 1], {"a": 1}]
_values = st.one_of(st.sampled_from(_samples), st.integers(-2**63, 2**63 - 1),  # (orjson: 64-bit ints)
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=3))
_fields = ["gen", "step", "ok", "ledger", "loss_sum", "mb_seconds", "lr", "reason", "weights_fingerprint", "healed", "x"]


_sent = {"vote": {"t": "vote", "gen": 3, "step": 7, "ok": True, "ledger": [[56, 64]], "loss_sum": 20.5,
                  "mb_seconds": 0.25, "lr": 1e-3},
         "join": {"t": "join", "gen": 4, "step": 7, "ledger": [[56, 64]]}}


@settings(max_examples=1500, deadline=None)
@given(kind=st.sampled_from(["vote", "join"]), fields=st.dictionaries(st.sampled_from(_fields), _values, max_size=3),
       dropped=st.sets(st.sampled_from(_fields), max_size=2))
def test_the_written_out_vote_and_join_checks_accept_only_what_the_tables_accept(kind, fields, dropped):
    """core.contract.wire's fast checks (R messages a step) never accept a message the tables refuse;
    the tables decide everything else. Messages: what a worker sends, a few fields changed or gone."""
    msg = {k: v for k, v in {**_sent[kind], **fields}.items() if k not in dropped}
    fast = _vote_ok(msg) if kind == "vote" else _join_ok(msg)
    if fast:
        assert _table_problem(kind, msg) == ""
    line = json.dumps(msg).encode()
    assert (parse_line(line)[0] is not None) == (_table_problem(kind, json.loads(line)) == "")


@pytest.mark.parametrize("kind", ["vote", "join"])
def test_every_one_field_change_is_judged_as_the_tables_judge_it(kind):
    """Each field of a worker's message set to each sample value, or dropped: wherever the
    fast check accepts, the tables do (the random search above combines changes)."""
    for name in _fields:
        for msg in [{**_sent[kind], name: v} for v in _samples] + [{k: v for k, v in _sent[kind].items() if k != name}]:
            if (_vote_ok(msg) if kind == "vote" else _join_ok(msg)):
                assert _table_problem(kind, msg) == "", msg


def test_the_workers_vote_and_join_take_the_fast_checks():
    assert _vote_ok(_sent["vote"]) and _vote_ok({**_sent["vote"], "weights_fingerprint": "ab" * 32})
    assert _join_ok(_sent["join"]) and _join_ok({**_sent["join"], "ledger": [], "healed": False})


def test_wire_parse_line_never_raises():
    @settings(max_examples=300, deadline=None)
    @given(line=st.one_of(st.binary(max_size=200), wrong_messages.map(lambda m: json.dumps(m).encode())))
    def check(line):
        msg, why = parse_line(line)
        assert (msg is None) == bool(why)

    check()
    assert parse_line(b"[" * 100_000)[0] is None  # nesting deep enough to blow the recursion limit
    assert parse_line(b'{"t": "hello", "replica": true, "token": "x"}')[0] is None  # a bool is not an id
    assert parse_line(b'{"t": "vote", "gen": 0, "step": 0, "ok": true, "ledger": [1.5]}')[0] is None
    assert parse_line(b'{"t": "vote", "gen": 0, "step": 0, "ok": true, "ledger": [0, 1]}')[0] is None  # ids, not ranges
    assert parse_line(b'{"t": "vote", "gen": 0, "step": 0, "ok": true, "ledger": [[2, 2]]}')[0] is None  # empty range
    ok_vote = b'{"t": "vote", "gen": 0, "step": 0, "ok": true, "ledger": [[0, 2]]'
    assert parse_line(ok_vote + b', "loss_sum": 1.5}')[0] is not None
    # loss_sum is required; null is a non-finite loss (core/contract/nonfinite.py), with or without named ids
    assert "loss_sum" in parse_line(ok_vote + b'}')[1]
    assert parse_line(ok_vote + b', "loss_sum": null}')[0] is not None
    assert parse_line(ok_vote + b', "loss_sum": null, "nonfinite": [[0, 1]]}')[0] is not None
    assert parse_line(ok_vote + b', "loss_sum": "1.5"}')[0] is None
    assert parse_line(b'{"t": "hb"}') == ({"t": "hb"}, "")


@pytest.mark.procs
def test_garbage_and_wrong_messages_at_a_live_coordinator_are_refused_and_the_run_is_unharmed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.experiments.cli", "launch", "--replicas", str(R), "--microbatches", str(M),
         "--steps", str(S), "--out", str(out), "--", sys.executable, str(script), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peers: list[str] = []
    try:
        deadline = time.monotonic() + 150
        while not (out / "control_addr").exists() or len(read_metrics(out / "metrics.jsonl")) < PAUSE_AT:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.05)
        host, port = (out / "control_addr").read_text().rsplit(":", 1)
        addr = (host, int(port))
        assert len(read_metrics(out / "metrics.jsonl")) == PAUSE_AT  # the run is live, paused mid-way

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(lines=lines)
        def throw(lines):
            # each connection ends in a wrong-token hello: its close proves every line before it was read
            peers.append(attack(addr, b"\n".join(lines) + b"\n" + WRONG_HELLO + b"\n"))

        throw()
        flood = attack(addr, b"garbage\n" * (MAX_REFUSALS + 2))  # no hello at all: closed for the garbage
        oversized = attack(addr, b"x" * (MAX_LINE_BYTES + 10) + b"\n" + WRONG_HELLO + b"\n")
        assert proc.poll() is None  # the coordinator took all of it
        (out / "attack_done").write_text("")
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout + stderr
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(S))
    assert all(m["members"] == [0, 1] and m["generation"] == 0 for m in metrics)  # no member disturbed
    for m, want in zip(metrics, failure_free_losses(script)):
        assert abs(m["loss"] - want) <= 1e-5 * abs(want), (m, want)
    events = read_jsonl(out / "events.jsonl")
    assert not [e for e in events if e["kind"] == "recovery"]
    # refusals are counted, one summary line per interval, not one line each
    refused = [e for e in events if e["kind"] == "refused"]
    whats: dict[str, int] = {}
    for e in refused:
        for w, n in e["what"].items():
            whats[w] = whats.get(w, 0) + n
    assert sum(e["closed"] for e in refused) >= len(peers) + 2  # every attacking connection ended closed
    assert any("wrong join token" in w for w in whats)
    assert any("malformed" in w for w in whats)
    assert any("oversized line" in w for w in whats)
    end = events[-1]
    assert end["kind"] == "run_end" and end["refused"] == sum(e["count"] for e in refused)
