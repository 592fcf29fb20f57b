"""The job store answers only connections that hold the job's secret, bounds what it holds and
who may wait on it, and never lets a client wait past its deadline on a frozen server
(issue 34: forged sets, unauthenticated deletes, junk keys, idle connections, frozen rank 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

from megatron.dynapipe.pipeline import job_store
from megatron.dynapipe.pipeline.job_store import (
    JobStore,
    StoreLimits,
    StoreRefused,
    StoreTimeout,
    StoreUnreachable,
)

SECRET = b"the job's secret, thirty-two by."


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.fixture
def store():
    served = JobStore.serve(_listener(), SECRET, timeout_s=10, answer_s=5)
    yield served
    served.close()


def test_set_get_add_check_delete_and_wait(store: JobStore) -> None:
    store.set("plan/0", b"\0bytes\xff")
    assert store.get("plan/0") == b"\0bytes\xff"
    assert store.add("acks", 2) == 2 and store.add("acks", 3) == 5
    assert store.check(["plan/0", "acks"]) and not store.check(["plan/0", "plan/1"])
    assert store.delete_key("plan/0") and not store.delete_key("plan/0")
    with pytest.raises(StoreRefused, match="no such key"):
        store.get("plan/0")
    with pytest.raises(StoreTimeout):
        store.wait(["plan/1"], 0.2)
    other = store.connect_again()
    setter = threading.Timer(0.3, other.set, args=("plan/1", b"late"))
    setter.start()
    store.wait(["plan/1"], 5.0)  # answered as soon as another connection sets it
    assert store.get("plan/1") == b"late"
    setter.join()
    other.close()


def test_a_stranger_without_the_secret_cannot_connect_read_or_write(store: JobStore) -> None:
    store.set("plan/0", b"the real plan")
    with pytest.raises(StoreUnreachable, match="did not complete its handshake"):
        JobStore(store.host, store.port, b"a guess at the job's secret", timeout_s=5)
    raw = socket.create_connection((store.host, store.port), timeout=5)
    greeting = raw.recv(1024)
    assert greeting.startswith(b"dynapipe-job-store/1\n")
    raw.sendall(b"\0" * 64)  # a wrong proof: the server hangs up without reading requests
    assert raw.recv(1024) == b""
    raw.close()
    assert store.get("plan/0") == b"the real plan"  # the job goes on, its entry untouched


def test_silent_and_surplus_connections_are_closed(monkeypatch) -> None:
    monkeypatch.setattr(job_store, "HANDSHAKE_S", 0.5)
    limits = StoreLimits(handshakes=4)
    store = JobStore.serve(_listener(), SECRET, limits=limits, timeout_s=10, answer_s=5)
    try:
        silent = [socket.create_connection((store.host, store.port), timeout=5) for _ in range(6)]
        for sock in silent:  # proving slots full: the surplus is closed at once
            sock.settimeout(5)
            while sock.recv(1024):
                pass  # the greeting, if any, then the server's hang-up
            sock.close()
        store.connect_again().close()  # the slots are free again for the job's ranks
    finally:
        store.close()


def test_keys_values_and_bytes_are_bounded() -> None:
    limits = StoreLimits(keys=3, key_bytes=16, value_bytes=100, stored_bytes=150)
    store = JobStore.serve(_listener(), SECRET, limits=limits, timeout_s=10, answer_s=5)
    try:
        store.set("a", b"x" * 60)
        with pytest.raises(StoreRefused, match="a value over 100 bytes"):
            store.set("b", b"x" * 101)
        with pytest.raises(StoreRefused, match="over 150 bytes"):
            store.set("b", b"x" * 100)
        with pytest.raises(StoreRefused, match="a key longer than 16 bytes"):
            store.set("k" * 17, b"")
        store.set("b", b"")
        store.set("c", b"")
        with pytest.raises(StoreRefused, match="already holds 3 keys"):
            store.add("d", 1)
        store.set("a", b"y" * 100)  # replacing a value counts only the difference
        assert [store.check([k]) for k in "abcd"] == [True, True, True, False]
        assert store.get("a") == b"y" * 100
    finally:
        store.close()


_FREEZABLE_SERVER = """
import socket, sys, time
from megatron.dynapipe.pipeline.job_store import JobStore
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
store = JobStore.serve(listener, bytes.fromhex(sys.argv[1]))
print(store.port, flush=True)
time.sleep(120)
"""


def test_a_frozen_server_is_reported_within_the_deadline() -> None:
    """A rank stopped by SIGSTOP still completes TCP handshakes (its kernel does) but answers
    nothing: every call, and a new connection, ends within its deadline."""
    server = subprocess.Popen(
        [sys.executable, "-c", _FREEZABLE_SERVER, SECRET.hex()], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        store = JobStore("127.0.0.1", port, SECRET, timeout_s=10, answer_s=1)
        store.set("plan/0", b"before the freeze")
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match="did not answer within 3 s"):
            store.wait(["plan/1"], 2.0)
        with pytest.raises(StoreUnreachable, match="did not complete its handshake"):
            store.connect_again(1.0)
        assert time.monotonic() - started < 10
    finally:
        server.kill()
        server.wait()
