"""The rendezvous store serves only holders of the run's join token.

A `StoreGuard` in front of a store on 127.0.0.1 (as the coordinator runs them); a client keyed by
the token (`core.launch.startup.keyed_store`) works; a client in another process without the token can
neither list, count, read, write nor delete the run's keys, and the run's keys are unchanged after
it tried. Pure checks of the request parser first.
"""
from __future__ import annotations

import struct
import subprocess
import sys
from datetime import timedelta

import pytest

from recover.core.contract.store_guard import (GET, GETNUMKEYS, PING, SET, VALIDATE, VALIDATE_MAGIC, Refused, _Need,
                                      parse_request, store_namespace)

PREFIX = ("/" + store_namespace("tok") + "/").encode()


def _key(k: bytes) -> bytes:
    return struct.pack("<Q", len(k)) + k


def test_namespace_is_a_secret_of_the_token():
    assert store_namespace("tok") == store_namespace("tok")
    assert store_namespace("tok") != store_namespace("tok2")
    assert "tok" not in store_namespace("tok") and len(store_namespace("tok")) == 36


def test_parser_forwards_keys_of_the_namespace_only():
    req = bytes([SET]) + _key(PREFIX + b"gen0/x") + _key(b"v")
    assert parse_request(req + b"\x03", PREFIX) == (len(req), SET)
    assert parse_request(struct.pack("<BI", VALIDATE, VALIDATE_MAGIC), PREFIX) == (5, VALIDATE)
    assert parse_request(struct.pack("<BI", PING, 7), PREFIX) == (5, PING)
    with pytest.raises(_Need):
        parse_request(req[:-1], PREFIX)
    for bad in (bytes([SET]) + _key(b"/gen0/x") + _key(b"v"), bytes([GET]) + _key(b"/run-0000/gen0/x"),
                bytes([GETNUMKEYS]), bytes([17]), struct.pack("<BI", VALIDATE, 1)):
        with pytest.raises(Refused):
            parse_request(bad, PREFIX)
    # a partial key that already differs is refused before the rest of it arrives
    with pytest.raises(Refused):
        parse_request(bytes([GET]) + struct.pack("<Q", 60_000) + b"/gen", PREFIX)
    with pytest.raises(Refused):
        parse_request(bytes([GET]) + struct.pack("<Q", 1 << 40), PREFIX)


HOSTILE = r"""
import sys, torch.distributed as dist
from datetime import timedelta
port = int(sys.argv[1])
def client():
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
tries = {
    "list_keys": lambda s: s.list_keys(),
    "num_keys": lambda s: s.num_keys(),
    # a set has no answer: the round trip after it shows whether the guard let it through
    "set": lambda s: (s.set("gen0/addr", b"evil"), s.get("gen0/addr")),
    "get": lambda s: s.get("gen0/addr"),
    "delete": lambda s: s.delete_key("gen0/addr"),
    "guessed_namespace": lambda s: (dist.PrefixStore("run-0123456789abcdef0123456789abcdef", s).set("gen0/addr", b"evil"),
                                    s.get("gen0/addr")),
}
for name, attempt in tries.items():
    try:
        attempt(client())
        print(name, "SUCCEEDED", flush=True)
    except Exception:
        print(name, "refused", flush=True)
"""


@pytest.mark.procs  # a client process beside the store
def test_a_client_without_the_token_cannot_find_or_overwrite_the_runs_keys(tmp_path):
    import torch.distributed as dist

    from recover.core.launch.startup import keyed_store
    from recover.core.contract.store_guard import StoreGuard, host_local_store

    inner = host_local_store()
    guard = StoreGuard("127.0.0.1", 0, inner.port, store_namespace("tok"))
    try:
        run = keyed_store(dist.TCPStore("127.0.0.1", guard.port, is_master=False, timeout=timedelta(seconds=10)),
                          "tok")
        run.set("gen0/addr", b"good")
        assert run.add("gen0/count", 2) == 2 and run.get("gen0/addr") == b"good"
        keys_before = sorted(inner.list_keys())
        script = tmp_path / "hostile.py"
        script.write_text(HOSTILE)
        out = subprocess.run([sys.executable, str(script), str(guard.port)], capture_output=True, text=True,
                             timeout=120)
        lines = [line for line in out.stdout.splitlines() if line]
        assert len(lines) == 6 and all(line.endswith(" refused") for line in lines), out.stdout + out.stderr[-2000:]
        assert guard.refused >= 4  # list_keys, num_keys, and keys outside the namespace (get waits first)
        assert sorted(inner.list_keys()) == keys_before
        assert run.get("gen0/addr") == b"good"  # the token holder's client still works
        # nothing was written by the hostile client: every key lies in the namespace
        assert all(k.lstrip("/").startswith(store_namespace("tok") + "/") for k in inner.list_keys())
    finally:
        guard.close()


def test_keyless_connections_are_bounded_and_a_keyed_client_is_served_past_the_deadline():
    """A peer without the token cannot hold the guard's descriptors (the bounds on
    the store port): past `max_keyless` the oldest keyless client is closed, and every keyless one
    is closed at `key_deadline`; a worker's client (keyed_store names a key at once) stays."""
    import socket
    import time

    import torch.distributed as dist

    from recover.core.launch.startup import keyed_store
    from recover.core.contract.store_guard import StoreGuard, host_local_store

    store = host_local_store()
    guard = StoreGuard("127.0.0.1", 0, store.port, store_namespace("tok"), key_deadline=4.0, max_keyless=4)
    idle = []
    try:
        worker = keyed_store(dist.TCPStore("127.0.0.1", guard.port, is_master=False, timeout=timedelta(seconds=5)),
                             "tok")
        for _ in range(6):
            idle.append(socket.create_connection(("127.0.0.1", guard.port)))
            time.sleep(0.02)  # accepted in order

        def closed(s: socket.socket, wait: float) -> bool:
            s.settimeout(wait)
            try:
                return s.recv(1) == b""
            except (TimeoutError, socket.timeout):
                return False
            except ConnectionResetError:
                return True

        # the two oldest made room for the last two; the four newest are still held
        # (generous waits: the guard's thread may be slow to run on a loaded machine; the
        # deadline is long enough that the four newest are still held when checked)
        assert closed(idle[0], 2.0) and closed(idle[1], 2.0)
        assert not any(closed(s, 0.05) for s in idle[2:]) and guard.keyless == 4
        assert all(closed(s, 8.0) for s in idle[2:])  # then the deadline closes them all
        assert guard.keyless == 0 and guard.expired == 6
        worker.set("gen0/addr", b"ok")  # the worker's client, connected all along, is served
        assert worker.get("gen0/addr") == b"ok"
    finally:
        for s in idle:
            s.close()
        guard.close()
