"""A hostile peer without the join token, against a live coordinator's control port.

`attack(addr, connections, seconds, ...)` opens `connections` TCP connections to `addr`
and never says hello on any of them; every `stream_every`-th one streams `stream_bytes`
of unterminated line (no newline), `chunk` bytes at a time. A connection the coordinator
closes is opened again, so the pressure lasts `seconds`, whatever the coordinator's
hello deadline and cap on connections without a hello do. One process, non-blocking
sockets, one selector: the attacker is cheap, the point is what it costs the coordinator.

Returns counts: connections opened (first opens and reopens), closed by the coordinator,
connect errors, bytes streamed, and the most held open at once.

Run as a script for a measurement (prints the counts as one JSON line):
    python tests/hostile_client.py HOST:PORT --connections 10000 --seconds 40
Its own open-file limit must exceed `connections` (it raises the soft limit to the hard one).
"""
from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import socket
import time


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class _Peer:
    __slots__ = ("sock", "streams", "left", "connected")

    def __init__(self, sock: socket.socket, streams: bool, stream_bytes: int):
        self.sock = sock
        self.streams = streams
        self.left = stream_bytes if streams else 0
        self.connected = False


def attack(addr: tuple[str, int], connections: int = 10_000, seconds: float = 30.0, stream_every: int = 10,
           stream_bytes: int = 64 << 10, chunk: int = 8 << 10, open_per_tick: int = 500,
           stop=lambda: False) -> dict:
    limit = _raise_nofile()
    connections = min(connections, limit - 64)
    sel = selectors.DefaultSelector()
    peers: dict[int, _Peer] = {}
    stats = {"connections": connections, "opened": 0, "closed_by_coordinator": 0, "connect_errors": 0,
             "bytes_streamed": 0, "max_open": 0, "seconds": 0.0}
    payload = b"x" * chunk
    opened_total = 0  # which connection this is, across reopens: every stream_every-th streams

    def open_one() -> None:
        nonlocal opened_total
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        rc = s.connect_ex(addr)
        if rc not in (0, errno.EINPROGRESS):
            s.close()
            stats["connect_errors"] += 1
            return
        p = _Peer(s, opened_total % stream_every == 0, stream_bytes)
        opened_total += 1
        peers[s.fileno()] = p
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, p)
        stats["opened"] += 1

    def drop(p: _Peer, by_coordinator: bool) -> None:
        peers.pop(p.sock.fileno(), None)
        sel.unregister(p.sock)
        p.sock.close()
        if by_coordinator:
            stats["closed_by_coordinator"] += 1

    t0 = time.monotonic()
    end = t0 + seconds
    try:
        while time.monotonic() < end and not stop():
            for _ in range(min(open_per_tick, connections - len(peers))):
                open_one()
            stats["max_open"] = max(stats["max_open"], len(peers))
            for key, ev in sel.select(timeout=0.05):
                p: _Peer = key.data
                if ev & selectors.EVENT_READ:
                    try:
                        data = p.sock.recv(65536)
                    except BlockingIOError:
                        data = None
                    except OSError:
                        data = b""
                    if data == b"":  # closed by the coordinator (or refused): open another
                        drop(p, p.connected)
                        if not p.connected:
                            stats["connect_errors"] += 1
                        continue
                if ev & selectors.EVENT_WRITE:
                    if not p.connected:
                        err = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if err:
                            drop(p, False)
                            stats["connect_errors"] += 1
                            continue
                        p.connected = True
                    if p.left > 0:
                        try:
                            n = p.sock.send(payload[:min(chunk, p.left)])
                            p.left -= n
                            stats["bytes_streamed"] += n
                        except BlockingIOError:
                            pass
                        except OSError:
                            drop(p, True)
                            continue
                    if p.left <= 0:  # nothing more to send: only wait for the close
                        sel.modify(p.sock, selectors.EVENT_READ, p)
    finally:
        stats["seconds"] = round(time.monotonic() - t0, 2)
        for p in list(peers.values()):
            drop(p, False)
        sel.close()
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr", help="HOST:PORT of the control port")
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--stream-every", type=int, default=10)
    ap.add_argument("--stream-bytes", type=int, default=64 << 10)
    a = ap.parse_args()
    host, port = a.addr.rsplit(":", 1)
    print(json.dumps(attack((host, int(port)), a.connections, a.seconds, a.stream_every, a.stream_bytes)), flush=True)


if __name__ == "__main__":
    main()
