"""`ControlClient.on_lost`: the heartbeat thread, not the training thread, says a connection is lost.

A local socket stands for the coordinator: closing it (as a dead coordinator's kernel does)
makes the client's next heartbeats fail, and `on_lost` runs on the heartbeat thread; a
connection the worker closes itself is not lost, and `on_lost` never runs.
"""
from __future__ import annotations

import socket
import threading

from recover.core.worker.control import ControlClient


def _server() -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(2)
    return srv


def test_a_coordinator_that_closes_is_reported_lost_from_the_heartbeat_thread():
    srv = _server()
    lost = threading.Event()
    seen: list[tuple[ControlClient, str]] = []

    def on_lost(client: ControlClient) -> None:
        seen.append((client, threading.current_thread().name))
        lost.set()

    client = ControlClient("127.0.0.1", srv.getsockname()[1], heartbeat_interval=0.02, on_lost=on_lost)
    conn, _ = srv.accept()
    try:
        conn.close()  # the coordinator's process died: its kernel closes the connection
        assert lost.wait(10), "on_lost never ran"
        assert seen == [(client, "control-heartbeat")]
        assert client.closed.is_set()
    finally:
        client.close()
        srv.close()


def test_a_connection_the_worker_closes_is_not_lost():
    srv = _server()
    lost = threading.Event()
    client = ControlClient("127.0.0.1", srv.getsockname()[1], heartbeat_interval=0.02,
                           on_lost=lambda c: lost.set())
    conn, _ = srv.accept()
    try:
        client.close()
        assert not lost.wait(0.3)  # several beats: the heartbeat thread has ended without a word
    finally:
        conn.close()
        srv.close()
