"""A front for the coordinator's rendezvous store that serves only the holders of the run's join token.

Contract:
- `store_namespace(token)` is the run's key namespace: "run-" and 32 hex digits of an HMAC-SHA256
  of the join token. Every store client of a worker wraps its TCPStore client in
  `PrefixStore(namespace, client)` (`core.launch.startup.keyed_store`), so each key it writes or reads
  starts with "<namespace>/". Without the token the namespace cannot be computed.
- `StoreGuard(host, port, upstream_port, namespace)` listens on (host, port) and speaks c10d's
  TCPStore wire protocol (torch 2.13: a query byte, then u64-length-prefixed keys and values).
  The real store listens on 127.0.0.1 only (`host_local_store`). For each client the guard
  parses every request and forwards it only when each key it names starts with the namespace;
  any other key, and every query that names no key but reads the store as a whole (GETNUMKEYS,
  LIST_KEYS) or that the workers never send (queues, BARRIER, unknown codes), closes that client.
  Why: c10d's store has no authentication, and `list_keys` hands any client every key, so a
  secret prefix alone hides nothing; the guard is the check in front.
- Until a client names a key of the namespace it holds no connection to the real store: the guard
  answers its VALIDATE and PING itself. Bounds: a key of at most 64 KiB, a value of at most
  1 GiB, 100,000 keys per request; a partial key that already differs from the namespace is
  refused before the rest arrives.
- Connections that never name a key are bounded, as the control port bounds those without a
  hello: a client that has not named a key of the namespace within `key_deadline` seconds of
  its accept is closed, and past `max_keyless` such clients the oldest is closed to make room
  (a worker names its key within a round trip of connecting: `core.launch.startup.keyed_store`
  checks one at once, so only a peer without the token stays keyless for long, and the
  oldest keyless client is the one most likely to be such a peer). An EMFILE on accept
  backs off instead of spinning. Why: without the bounds a tokenless peer could hold the
  coordinator's descriptors, which the control port and the store share.
- One daemon thread, one selector; `close()` stops it and closes every socket. Counts:
  `refused` (clients closed for a bad request), `expired` (closed keyless at the deadline or to
  make room), `clients` (open now), `keyless` (open now without a key named).
"""
from __future__ import annotations

import hashlib
import hmac
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict

NAMESPACE_INFO = b"recover rendezvous store namespace v1"
MAX_KEY = 64 * 1024
MAX_VALUE = 1 << 30
MAX_KEYS = 100_000
KEY_DEADLINE = 10.0  # seconds a client may stay connected without naming a key of the namespace
MAX_KEYLESS = 1024  # keyless clients held at once; past it the oldest is closed
VALIDATE_MAGIC = 0x3C85F7CE

# c10d::detail::QueryType (TCPStoreBackend.hpp)
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, \
    CANCEL_WAIT, PING = range(14)
WAIT_CANCELED = 1


def store_namespace(token: str) -> str:
    """The run's store namespace, derived from its join token (not guessable without it)."""
    return "run-" + hmac.new(token.encode(), NAMESPACE_INFO, hashlib.sha256).hexdigest()[:32]


class Refused(Exception):
    """A request the guard does not forward."""


class _Need(Exception):
    """The request is not complete yet: at least `n` bytes are needed."""

    def __init__(self, n: int):
        self.n = n


def parse_request(buf: bytes | bytearray | memoryview, prefix: bytes) -> tuple[int, int]:
    """(length, query) of the first complete request in `buf`; raises _Need(n) when incomplete,
    Refused when it names a key outside `prefix` or is a query the guard does not forward."""
    pos = 0
    n = len(buf)

    def take(size: int) -> int:
        nonlocal pos
        if pos + size > n:
            raise _Need(pos + size)
        start = pos
        pos += size
        return start

    def u64() -> int:
        return struct.unpack_from("<Q", buf, take(8))[0]

    def key() -> None:
        size = u64()
        if size > MAX_KEY or size < len(prefix):
            raise Refused("a key outside the run's namespace")
        if not prefix.startswith(bytes(buf[pos:min(n, pos + len(prefix))])):
            raise Refused("a key outside the run's namespace")
        take(size)

    def value() -> None:
        size = u64()
        if size > MAX_VALUE:
            raise Refused(f"value of {size} bytes")
        take(size)

    def count() -> int:
        c = u64()
        if c > MAX_KEYS:
            raise Refused(f"{c} keys in one request")
        return c

    q = buf[take(1)]
    if q == VALIDATE:
        if struct.unpack_from("<I", buf, take(4))[0] != VALIDATE_MAGIC:
            raise Refused("bad validation number")
    elif q == PING:
        take(4)
    elif q == CANCEL_WAIT:
        pass
    elif q in (SET, APPEND):
        key(), value()
    elif q == COMPARE_SET:
        key(), value(), value()
    elif q in (GET, DELETE_KEY):
        key()
    elif q == ADD:
        key(), take(8)
    elif q in (CHECK, WAIT, MULTI_GET):
        for _ in range(count()):
            key()
    elif q == MULTI_SET:
        for _ in range(count()):
            key(), value()
    else:
        raise Refused(f"query {q}")
    return pos, q


class _Client:
    __slots__ = ("sock", "up", "inbuf", "to_up", "to_client", "authed", "validated", "since")

    def __init__(self, sock: socket.socket):
        self.since = time.monotonic()
        self.sock, self.up = sock, None
        self.inbuf = bytearray()
        self.to_up, self.to_client = bytearray(), bytearray()
        self.authed = self.validated = False


class StoreGuard:
    def __init__(self, host: str, port: int, upstream_port: int, namespace: str, upstream_host: str = "127.0.0.1",
                 key_deadline: float = KEY_DEADLINE, max_keyless: int = MAX_KEYLESS):
        self.key_deadline, self.max_keyless = key_deadline, max_keyless
        # keyless clients in accept order: the deadline expires them from the front, O(1) each
        self._keyless: OrderedDict[socket.socket, _Client] = OrderedDict()
        self.expired = 0
        self.prefix = ("/" + namespace + "/").encode()  # TCPStore sends every key as "/" + key
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.refused, self.last_refusal = 0, ""
        self._clients: dict[socket.socket, _Client] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="store-guard", daemon=True)
        self._thread.start()

    @property
    def clients(self) -> int:
        return len({id(c) for c in self._clients.values()})

    @property
    def keyless(self) -> int:
        return len(self._keyless)

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._expire()
                for key, mask in self.sel.select(min(1.0, self.key_deadline / 2)):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        client = key.data
                        try:
                            if mask & selectors.EVENT_READ:
                                self._readable(client, key.fileobj)
                            if mask & selectors.EVENT_WRITE and client.sock.fileno() >= 0:
                                self._flush(client)
                        except (OSError, Refused) as e:
                            if isinstance(e, Refused):
                                self.refused += 1
                                self.last_refusal = str(e)
                            self._drop(client)
        finally:
            for client in list(self._clients.values()):
                self._drop(client)
            for s in (self.listener, self._wake_r, self._wake_w):
                s.close()
            self.sel.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # EMFILE and the like: free a descriptor held by a keyless client, else back off
            if self._keyless:
                self.expired += 1
                self._drop(next(iter(self._keyless.values())))
            else:
                self._stop.wait(0.05)
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self._keyless) >= self.max_keyless:  # room for this one: the oldest keyless client goes
            self.expired += 1
            self._drop(next(iter(self._keyless.values())))
        client = _Client(sock)
        self._clients[sock] = client
        self._keyless[sock] = client
        self.sel.register(sock, selectors.EVENT_READ, client)

    def _expire(self) -> None:
        """Close the keyless clients past the deadline (the oldest first; they are in accept order)."""
        too_old = time.monotonic() - self.key_deadline
        while self._keyless:
            client = next(iter(self._keyless.values()))
            if client.since > too_old:
                return
            self.expired += 1
            self._drop(client)

    def _readable(self, client: _Client, sock: socket.socket) -> None:
        data = sock.recv(1 << 20)
        if not data:
            raise OSError("closed")
        if sock is client.up:
            client.to_client += data
        else:
            client.inbuf += data
            self._parse(client)
        self._flush(client)

    def _parse(self, client: _Client) -> None:
        buf = client.inbuf
        while buf:
            # re-parsed from its start as bytes arrive: the cost is the request's keys, never its
            # values, and a key outside the namespace is refused as soon as it differs
            try:
                with memoryview(buf) as view:
                    length, q = parse_request(view, self.prefix)
            except _Need:
                return
            request = bytes(buf[:length])
            del buf[:length]
            if client.authed:
                client.to_up += request
            elif q == VALIDATE:
                client.validated = True
            elif q == PING:
                client.to_client += request[1:5]  # the nonce back, as the store answers
            elif q == CANCEL_WAIT:
                client.to_client += bytes([WAIT_CANCELED])
            else:  # the first request that names the namespace: connect to the real store
                if not client.validated:
                    raise Refused("a request before validation")
                up = socket.create_connection(self.upstream, timeout=10)
                up.setblocking(False)
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client.up, client.authed = up, True
                self._keyless.pop(client.sock, None)
                self._clients[up] = client
                self.sel.register(up, selectors.EVENT_READ, client)
                client.to_up += struct.pack("<BI", VALIDATE, VALIDATE_MAGIC) + request

    def _flush(self, client: _Client) -> None:
        if len(client.to_client) > (MAX_VALUE if client.authed else MAX_KEY):
            raise Refused("answers the client does not read")
        for sock, out in ((client.up, client.to_up), (client.sock, client.to_client)):
            if sock is None or not out:
                continue
            try:
                sent = sock.send(out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            del out[:sent]
        for sock, out in ((client.up, client.to_up), (client.sock, client.to_client)):
            if sock is not None:
                self.sel.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0), client)

    def _drop(self, client: _Client) -> None:
        self._keyless.pop(client.sock, None)
        for sock in (client.sock, client.up):
            if sock is None:
                continue
            self._clients.pop(sock, None)
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()


def host_local_store():
    """The real store, listening on 127.0.0.1 only (the guard is its one way in from the network)."""
    from datetime import timedelta

    import torch.distributed as dist

    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300),
                         multi_tenant=True, master_listen_fd=listener.detach())  # the store owns the fd
