"""Each iteration's plan reaches every rank, planned once: rank 0 plans, the others read a store.

DynaPipe's planners push every execution plan to an instruction store in the host memory of
machine 0, and the executors fetch their instructions from it (seed `dynapipe.txt` §3; §7 uses
Redis). Here that store is the job's own (`job_store.JobStore`): a server thread in the
publishing rank's process that every rank reaches over TCP, with blocking waits that the server
answers as soon as a key is set, so there is no extra service to deploy and no polling.

`PlanChannel` on the publishing rank (rank 0 by default) takes plans from a
`dynapipe_planner.service.PlanningService` (or from explicit `publish` calls) and sets
`dynapipe/plan/{iteration}` to the plan's compact binary form; on the other ranks `fetch` waits
for that key, logging while it waits and failing with an error that names the iteration and the
planning rank when it never comes. Every reader then adds one to `dynapipe/plan/{iteration}/acks`;
the last reader deletes both keys, so the store holds only plans some rank has still to read,
and the publisher needs no extra round trip to clean up.

When the planner refuses an iteration's batch (a `PlanningError`: the input's fault, such as
a model that fits nowhere), the publisher writes the refusal under the plan's key instead and
waits, a bounded time, until every reader has read it before it raises: each reader then raises
the same `PlanningError`, so the job ends as a user error on every rank, reported once, rather
than with readers that lose the store when the publisher exits.

A plan is a program every rank runs, so the store is guarded three times. Its server listens only
on the address the job was given, not on every interface. Only connections that prove they hold
the per-job secret (`new_job_secret`, handed to the ranks over the job's process group, never
through the store) may read or write, so a stranger can neither forge, delete nor flood entries.
And every entry carries an HMAC-SHA256 of its key and bytes under that secret: bytes altered on
the way, or an old plan replayed under another iteration's key, are refused before they are
decoded, naming the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator

from dynapipe_planner.errors import (
    PlanningError,
    PlanningServiceError,
    PlanTimeoutError,
    iteration_name,
)
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.service import PlanningService

from .job_store import JobStore, StoreTimeout, StoreUnreachable

_log = logging.getLogger(__name__)


MAC_BYTES = hashlib.sha256().digest_size
# A store entry that carries the planner's refusal, not a plan (plans start with plan.MAGIC).
REFUSAL = b"\0dynapipe-refused\0"
REFUSAL_WAIT_S = 30.0


def new_job_secret() -> bytes:
    """A fresh key for the plan entries' MACs (the planning rank draws it once per job)."""
    return secrets.token_bytes(32)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `host:port` only (port 0: one the OS picks)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        raise PlanningServiceError(f"the plan store cannot listen on {host}:{port}: {e}") from e
    return sock


# Addresses that bind a listening socket on every interface.
_EVERY_INTERFACE = ("", "0.0.0.0", "::", "[::]")


def open_plan_store(
    rank: int,
    *,
    secret: bytes,
    host: str | None = None,
    port: int | None = None,
    publisher_rank: int = 0,
    timeout_s: float = 600.0,
) -> JobStore:
    """The job's store for plans, served by `publisher_rank` at `host:port` (default:
    MASTER_ADDR and MASTER_PORT + 1; port 0 on the publisher: one the OS picks, then
    `store.port`) and listening on that address only. Other ranks retry connecting until
    `timeout_s`; every rank must hold the job's `secret`."""
    try:
        host = host if host is not None else os.environ["MASTER_ADDR"]
        port = port if port is not None else int(os.environ["MASTER_PORT"]) + 1
    except KeyError as e:
        raise PlanningServiceError(
            f"the plan store needs a host and port: pass them or set {e.args[0]}"
        ) from e
    if rank == publisher_rank:
        if host in _EVERY_INTERFACE:
            print(
                f"warning: MASTER_ADDR {host or '(empty)'} makes the plan store listen on every "
                "network interface; its entries are authenticated, but anyone who reaches the "
                "port can connect: set MASTER_ADDR to the job's own address",
                file=sys.stderr,
                flush=True,
            )
        return JobStore.serve(_listening_socket(host, port), secret, timeout_s=timeout_s)
    return JobStore(host, port, secret, timeout_s=timeout_s)


class PlanChannel:
    """Hands every rank the plan of each iteration; only `publisher_rank` plans.

    On the publisher, `fetch(n)` returns a plan given to `publish(n, ...)` or else takes it from
    `service` and publishes it; elsewhere it waits for the publisher's plan in `store`. Each rank
    fetches each iteration once. Every rank holds the job's `secret`; entries are sealed with it.
    """

    def __init__(
        self,
        store: JobStore,
        rank: int,
        world_size: int,
        *,
        secret: bytes,
        service: PlanningService | None = None,
        publisher_rank: int = 0,
        timeout_s: float = 600.0,
        log_interval_s: float = 30.0,
        prefix: str = "dynapipe/plan",
        logger: logging.Logger | None = None,
    ) -> None:
        if not 0 <= publisher_rank < world_size or not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} and publisher rank {publisher_rank} must be in [0, {world_size})"
            )
        if service is not None and rank != publisher_rank:
            raise ValueError(
                f"rank {rank} got a planning service; only rank {publisher_rank} plans"
            )
        if len(secret) < 16:
            raise ValueError("the plan channel's secret must have at least 16 bytes")
        self.store, self.rank, self.world_size, self.secret = store, rank, world_size, secret
        self.service, self.publisher_rank = service, publisher_rank
        self.timeout_s, self.log_interval_s, self.prefix = timeout_s, log_interval_s, prefix
        self._log = logger or _log
        self._published: dict[int, bytes] = {}  # the publisher's own copies, until it fetches

    @property
    def is_publisher(self) -> bool:
        return self.rank == self.publisher_rank

    def publish(self, iteration: int, plan: ExecutionPlan | bytes) -> None:
        """Make `plan` the plan of `iteration` for every rank (publisher only)."""
        if not self.is_publisher:
            raise PlanningServiceError(
                f"rank {self.rank} cannot publish {iteration_name(iteration)}: rank "
                f"{self.publisher_rank} is the planner"
            )
        data = plan if isinstance(plan, bytes) else plan.to_bytes()
        if self.world_size > 1:
            key = self._key(iteration)
            self.store.set(key, self._mac(key, data) + data)
        self._published[iteration] = data

    def fetch(self, iteration: int, timeout_s: float | None = None) -> ExecutionPlan:
        """This iteration's plan, waiting at most `timeout_s` (default: the channel's)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        source = f"plan of {iteration_name(iteration)}"
        if self.is_publisher:
            if iteration not in self._published:
                if self.service is None:
                    raise PlanningServiceError(
                        f"rank {self.rank} has no plan for {iteration_name(iteration)}: publish it "
                        f"first or give the channel a planning service"
                    )
                try:
                    planned = self.service.get_planned(iteration, timeout)
                except PlanningError as refusal:
                    self._hand_on(iteration, refusal)
                    raise
                self.publish(iteration, planned.data)
            return ExecutionPlan.from_bytes(self._published.pop(iteration), source)
        key = self._key(iteration)
        self._wait(key, iteration, timeout)
        with self._store_lost(iteration, "reading"):
            sealed = self.store.get(key)
            if self.store.add(f"{key}/acks", 1) == self.world_size - 1:
                self.store.delete_key(key)
                self.store.delete_key(f"{key}/acks")
        data = self._opened(key, sealed)
        if data.startswith(REFUSAL):
            raise PlanningError(data[len(REFUSAL) :].decode(errors="replace"))
        return ExecutionPlan.from_bytes(data, source)

    def _hand_on(self, iteration: int, refusal: PlanningError) -> None:
        """Publish the planner's refusal of `iteration` and wait (at most `REFUSAL_WAIT_S`)
        until every reader has taken it, so the store outlives their reads."""
        if self.world_size == 1:
            return
        key = self._key(iteration)
        data = REFUSAL + str(refusal).encode()
        self.store.set(key, self._mac(key, data) + data)
        deadline = time.monotonic() + min(self.timeout_s, REFUSAL_WAIT_S)
        while time.monotonic() < deadline:
            if not self.store.check([key]):
                return  # the last reader deleted it
            time.sleep(0.05)

    def _mac(self, key: str, data: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + data, hashlib.sha256).digest()

    def _opened(self, key: str, sealed: bytes) -> bytes:
        """The plan bytes of a store entry whose MAC holds, else an error naming the key."""
        mac, data = sealed[:MAC_BYTES], sealed[MAC_BYTES:]
        if len(mac) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, data)):
            raise PlanningServiceError(
                f"rank {self.rank}: plan store entry {key!r} fails authentication (not written "
                f"by this job's planning rank {self.publisher_rank}, or replayed from another "
                "key); refusing to run it"
            )
        return data

    @contextlib.contextmanager
    def _store_lost(self, iteration: int, doing: str) -> Iterator[None]:
        """A store that drops the connection means its server, the planning rank, is gone."""
        try:
            yield
        except StoreUnreachable as e:
            raise PlanningServiceError(
                f"rank {self.rank}: lost the plan store of rank {self.publisher_rank} (the "
                f"planner) while {doing} the plan of {iteration_name(iteration)}: {e}"
            ) from e

    def _key(self, iteration: int) -> str:
        return f"{self.prefix}/{iteration}"

    def _wait(self, key: str, iteration: int, timeout: float) -> None:
        started = time.monotonic()
        deadline = started + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PlanTimeoutError(
                    f"rank {self.rank}: no plan for {iteration_name(iteration)} after "
                    f"{timeout:.1f} s; "
                    f"rank {self.publisher_rank} plans and publishes it (store key {key!r}): "
                    f"is it alive, and is its planner keeping up?"
                )
            try:
                with self._store_lost(iteration, "waiting for"):
                    self.store.wait([key], min(remaining, self.log_interval_s))
                return
            except StoreTimeout:
                pass  # not there yet
            if time.monotonic() < deadline:
                self._log.warning(
                    "rank %d waiting for plan of %s from rank %d (the planner), %.1f s so far",
                    self.rank,
                    iteration_name(iteration),
                    self.publisher_rank,
                    time.monotonic() - started,
                )
