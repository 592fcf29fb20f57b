"""The job's own key-value store for plans and heartbeats, open to the job's ranks only.

DynaPipe's planners hand each plan to the executors through an instruction store in the host
memory of machine 0 (seed `dynapipe.txt` §3; §7 uses Redis). torch's `TCPStore` played that
part, but anyone who reaches its port may set, delete or flood keys and hold connections open,
and a client of a frozen server (its rank stopped by a signal or a debugger) can wait for ever.
This store is small enough to own those properties:

- every connection proves, in both directions, that it holds the job's secret (an HMAC over two
  fresh nonces) within `HANDSHAKE_S` before any request is read; a connection that does not is
  closed, so a stranger can neither write nor delete a key, nor keep a descriptor for long;
- keys, value sizes, stored bytes and connections are bounded (`StoreLimits`); a request past a
  bound is refused with a `StoreRefused` naming it, and the store stays as it was;
- every client call has a deadline: a server that does not answer in time is `StoreUnreachable`.

The server is a thread of the serving rank's process (`JobStore.serve`); each connection gets a
thread of its own, so a rank's long `wait` holds up no one else. Values are bytes; `add` keeps a
decimal counter, as torch's stores do.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

HANDSHAKE_S = 5.0
_HELLO = b"dynapipe-job-store/1\n"
_NONCE_BYTES = 32
_MAX_PARTS = 1024  # fields of one request: an op, its keys and values


class StoreError(RuntimeError):
    """A job-store call failed."""


class StoreUnreachable(StoreError):
    """The store's server did not answer in time, or the connection is gone."""


class StoreTimeout(StoreError):
    """A `wait` ended before every key it waited for was set (the server answered)."""


class StoreRefused(StoreError):
    """The server refused a request: a bound would be passed, or the key is missing."""


@dataclass(frozen=True)
class StoreLimits:
    """What the server holds at most. Plans are the large values (a few MB for a big batch);
    the job keeps only the plans some rank has still to read, one counter per rank and one
    acknowledgement counter per plan."""

    keys: int = 10_000
    key_bytes: int = 1024
    value_bytes: int = 1 << 30
    stored_bytes: int = 2 << 30
    connections: int = 256  # authenticated ones; each rank holds two or three
    handshakes: int = 64  # connections still proving themselves


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send_parts(sock: socket.socket, parts: list[bytes]) -> None:
    header = struct.pack("!I", len(parts)) + b"".join(struct.pack("!Q", len(p)) for p in parts)
    sock.sendall(header + b"".join(parts))


def _read_parts(sock: socket.socket, max_bytes: int) -> list[bytes]:
    """One framed message; a frame declaring more than `max_bytes` is a protocol error before
    anything of that size is allocated."""
    (count,) = struct.unpack("!I", _read_exactly(sock, 4))
    if count > _MAX_PARTS:
        raise ConnectionError(f"a message of {count} parts")
    sizes = struct.unpack(f"!{count}Q", _read_exactly(sock, 8 * count))
    if sum(sizes) > max_bytes:
        raise ConnectionError(f"a message of {sum(sizes)} bytes")
    return [_read_exactly(sock, size) for size in sizes]


class _Server:
    """The serving thread and the data; see the module docstring."""

    def __init__(self, listener: socket.socket, secret: bytes, limits: StoreLimits) -> None:
        self.secret, self.limits, self.listener = secret, limits, listener
        self.data: dict[bytes, bytes] = {}
        self.stored = 0
        self.changed = threading.Condition()
        self.open: set[socket.socket] = set()
        self.proving = 0
        self.members = 0
        self.closed = False
        threading.Thread(target=self._accept, name="dynapipe-job-store", daemon=True).start()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            connections = list(self.open)
            self.changed.notify_all()
        for sock in [self.listener, *connections]:
            _shut(sock)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.changed:
                if self.closed or self.proving >= self.limits.handshakes:
                    conn.close()
                    continue
                self.proving += 1
                self.open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        member = False
        try:
            conn.settimeout(HANDSHAKE_S)
            try:
                proven = self._handshake(conn)
            except (OSError, struct.error):
                proven = False
            with self.changed:
                self.proving -= 1
                member = proven and self.members < self.limits.connections
                self.members += member
            if not member:
                return
            conn.settimeout(None)  # a rank may stay quiet while it computes
            request_cap = self.limits.value_bytes + 2 * self.limits.key_bytes + 64
            while True:
                _send_parts(conn, self._answer(_read_parts(conn, request_cap)))
        except (OSError, struct.error, ValueError):
            pass  # gone, or not speaking the protocol: drop the connection
        finally:
            with self.changed:
                self.members -= member
                self.open.discard(conn)
            _shut(conn)

    def _handshake(self, conn: socket.socket) -> bool:
        """Both sides prove they hold the secret; the client first, so a stranger learns
        nothing but the greeting and a nonce."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(_HELLO + nonce)
        reply = _read_exactly(conn, _NONCE_BYTES + hashlib.sha256().digest_size)
        theirs, proof = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
        if not hmac.compare_digest(proof, _proof(self.secret, b"client", nonce, theirs)):
            return False
        conn.sendall(_proof(self.secret, b"server", theirs, nonce))
        return True

    def _answer(self, request: list[bytes]) -> list[bytes]:
        op, args = request[0], request[1:]
        if any(len(key) > self.limits.key_bytes for key in args[:1]):
            return [b"refused", f"a key longer than {self.limits.key_bytes} bytes".encode()]
        with self.changed:
            if op == b"set" and len(args) == 2:
                return self._put(args[0], args[1])
            if op == b"get" and len(args) == 1:
                value = self.data.get(args[0])
                return [b"ok", value] if value is not None else [b"refused", b"no such key"]
            if op == b"add" and len(args) == 2:
                total = int(self.data.get(args[0], b"0")) + int(args[1])
                return self._put(args[0], str(total).encode(), reply=[b"ok", str(total).encode()])
            if op == b"check":
                return [b"ok", b"1" if all(k in self.data for k in args) else b"0"]
            if op == b"delete" and len(args) == 1:
                value = self.data.pop(args[0], None)
                if value is not None:
                    self.stored -= len(args[0]) + len(value)
                return [b"ok", b"1" if value is not None else b"0"]
            if op == b"wait" and args:
                seen = self.changed.wait_for(
                    lambda: self.closed or all(k in self.data for k in args[1:]),
                    timeout=int(args[0]) / 1000,
                )
                return [b"ok"] if seen and not self.closed else [b"timeout"]
        return [b"refused", b"malformed request"]

    def _put(self, key: bytes, value: bytes, reply: list[bytes] | None = None) -> list[bytes]:
        """Store `key` (the caller holds the lock) unless a bound would be passed."""
        old = self.data.get(key)
        grown = len(key) + len(value) - (len(key) + len(old) if old is not None else 0)
        limits = self.limits
        if len(value) > limits.value_bytes:
            return [b"refused", f"a value over {limits.value_bytes} bytes".encode()]
        if old is None and len(self.data) >= limits.keys:
            return [b"refused", f"the store already holds {limits.keys} keys".encode()]
        if self.stored + grown > limits.stored_bytes:
            return [b"refused", f"the store would hold over {limits.stored_bytes} bytes".encode()]
        self.data[key] = value
        self.stored += grown
        self.changed.notify_all()
        return reply or [b"ok"]


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already shut, or never connected
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class JobStore:
    """One connection to the job's store (and, on the serving rank, the server itself).

    Calls are serialised per connection; a thread that must not queue behind another's long
    `wait` opens its own with `connect_again`. `answer_s` bounds how long any call waits for
    the server beyond what the call itself asks to wait.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        *,
        timeout_s: float = 600.0,
        answer_s: float = 30.0,
        _server: _Server | None = None,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the job store's secret must have at least 16 bytes")
        self.host, self.port, self.secret = host, port, secret
        self.timeout_s, self.answer_s = timeout_s, min(answer_s, timeout_s)
        self._server = _server
        self._lock = threading.Lock()
        self._sock = self._connect(timeout_s)

    @classmethod
    def serve(
        cls,
        listener: socket.socket,
        secret: bytes,
        *,
        limits: StoreLimits | None = None,
        timeout_s: float = 600.0,
        answer_s: float = 30.0,
    ) -> JobStore:
        """Serve the store on `listener` (a listening socket the store now owns) and return
        this process's connection to it."""
        host, port = listener.getsockname()[:2]
        server = _Server(listener, secret, limits or StoreLimits())
        try:
            return cls(host, port, secret, timeout_s=timeout_s, answer_s=answer_s, _server=server)
        except BaseException:
            server.close()
            raise

    def connect_again(self, timeout_s: float | None = None) -> JobStore:
        """Another connection to the same store (calls on it never queue behind this one's)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return JobStore(self.host, self.port, self.secret, timeout_s=timeout, answer_s=timeout)

    def close(self) -> None:
        """Close this connection, and the server if this process serves it."""
        _shut(self._sock)
        if self._server is not None:
            self._server.close()

    def set(self, key: str, value: bytes) -> None:
        self._call(b"set", key.encode(), value)

    def get(self, key: str) -> bytes:
        """The value of `key`; `StoreRefused` if it is not set."""
        return self._call(b"get", key.encode())[0]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (0 when unset) and return the new total."""
        return int(self._call(b"add", key.encode(), str(int(amount)).encode())[0])

    def check(self, keys: list[str]) -> bool:
        """Whether every one of `keys` is set."""
        return self._call(b"check", *(k.encode() for k in keys))[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call(b"delete", key.encode())[0] == b"1"

    def wait(self, keys: list[str], timeout_s: float) -> None:
        """Return once every one of `keys` is set; `StoreTimeout` after `timeout_s`."""
        millis = str(max(0, round(timeout_s * 1000))).encode()
        self._call(b"wait", millis, *(k.encode() for k in keys), waiting_s=timeout_s)

    def _call(self, op: bytes, *args: bytes, waiting_s: float = 0.0) -> list[bytes]:
        with self._lock:
            try:
                self._sock.settimeout(waiting_s + self.answer_s)
                _send_parts(self._sock, [op, *args])
                status, *reply = _read_parts(self._sock, 1 << 40)
            except (OSError, struct.error, ValueError) as e:
                raise StoreUnreachable(
                    f"the job store at {self.host}:{self.port} did not answer within "
                    f"{waiting_s + self.answer_s:.0f} s ({e or type(e).__name__})"
                ) from e
        if status == b"timeout":
            raise StoreTimeout(f"keys not set after {waiting_s:.1f} s")
        if status != b"ok":
            raise StoreRefused(
                f"the job store refused {op.decode()} {args[0][:80]!r}: {reply[0].decode()}"
            )
        return reply

    def _connect(self, timeout_s: float) -> socket.socket:
        """A connection that has passed the handshake; retried until `timeout_s` while the
        server is not listening yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=min(HANDSHAKE_S, timeout_s)
                )
                break
            except ConnectionRefusedError as e:
                if time.monotonic() >= deadline:
                    raise StoreUnreachable(
                        f"the job store at {self.host}:{self.port} refused connections for "
                        f"{timeout_s:.0f} s"
                    ) from e
                time.sleep(0.1)
            except OSError as e:
                raise StoreUnreachable(
                    f"cannot reach the job store at {self.host}:{self.port}: {e}"
                ) from e
        try:
            sock.settimeout(min(max(HANDSHAKE_S, self.answer_s), timeout_s))
            greeting = _read_exactly(sock, len(_HELLO) + _NONCE_BYTES)
            if not greeting.startswith(_HELLO):
                raise ConnectionError("not a DynaPipe job store")
            theirs, ours = greeting[len(_HELLO) :], secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(ours + _proof(self.secret, b"client", theirs, ours))
            answer = _read_exactly(sock, hashlib.sha256().digest_size)
            if not hmac.compare_digest(answer, _proof(self.secret, b"server", ours, theirs)):
                raise ConnectionError("the server does not hold this job's secret")
        except (OSError, ValueError) as e:
            _shut(sock)
            raise StoreUnreachable(
                f"the job store at {self.host}:{self.port} did not complete its handshake: "
                f"{e or type(e).__name__}"
            ) from e
        return sock
