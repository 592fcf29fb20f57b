"""Which rank stopped answering: heartbeats in the plan store, read when a training step fails.

A failed distributed step rarely names its culprit: gloo reports "connection closed by peer"
with an address, NCCL and collectives just time out. To end the job with an error that names the
rank and the iteration instead of a bare transport error (or a hang), every rank's daemon thread
bumps a counter `dynapipe/alive/{rank}` in the store that already carries the plans (DynaPipe's
instruction store, seed `dynapipe.txt` §3 and §7) every `interval_s`. When a step fails,
`Liveness.step` reads the other ranks' counters twice, `window_s` apart, and names those that
did not move; if the store itself is gone, its server (the planning rank) is the one that stopped.
Every blocking operation of a step is bounded (p2p waits and process groups by
`--dynapipe-timeout`), so a dead peer always surfaces as a failure that reaches this check.

The thread has its own store connection: a connection serves one request at a time, and the
main thread may sit in a long wait for a plan. Every store call has a deadline
(`job_store.JobStore`), so a frozen server (its rank stopped) is found, not waited for.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from dynapipe_planner.errors import iteration_name

from .job_store import JobStore, StoreError

PREFIX = "dynapipe/alive"


class PeerFailure(RuntimeError):
    """A training step failed; the message names this rank, the iteration and the ranks that
    stopped answering (or says that all still answer), then the original error."""


class Liveness:
    """Heartbeats of this rank, and the check of the others' (a context manager)."""

    def __init__(
        self,
        store: JobStore,
        rank: int,
        world_size: int,
        *,
        server_rank: int = 0,
        interval_s: float = 0.5,
        window_s: float = 2.0,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.server_rank, self.interval_s, self.window_s = server_rank, interval_s, window_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.diagnosing = False  # a check is under way (its report is about to be raised)

    def start(self) -> None:
        """Start beating (no-op for a one-rank job, which has no one to tell)."""
        if self.world_size == 1 or self._thread is not None:
            return
        conn = self.store.connect_again(max(10 * self.interval_s, 5.0))
        conn.add(self._key(self.rank), 1)
        self._thread = threading.Thread(
            target=self._beat, args=(conn,), name=f"dynapipe-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)

    def __enter__(self) -> Liveness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def diagnose(self) -> str:
        """Which other ranks stopped answering: those whose heartbeat did not move for
        `window_s`, or the store's server if the store cannot be reached."""
        others = [r for r in range(self.world_size) if r != self.rank]
        if not others:
            return "no other rank takes part"
        self.diagnosing = True
        try:
            before = self._read_beats(others)
            if before is not None:
                time.sleep(self.window_s)
            after = self._read_beats(others) if before is not None else None
        finally:
            self.diagnosing = False
        if before is None or after is None:
            return (
                f"rank {self.server_rank} stopped answering (the plan store it serves is "
                f"unreachable)"
            )
        silent = [str(r) for r, b, a in zip(others, before, after, strict=True) if a == b]
        if not silent:
            return "every other rank still answers"
        ranks = f"rank{'s' if len(silent) > 1 else ''} {', '.join(silent)}"
        return f"{ranks} stopped answering (no heartbeat for {self.window_s:g} s)"

    def _read_beats(self, ranks: list[int]) -> list[int] | None:
        """The heartbeat counters of `ranks`, or None when the store does not answer within
        twice the window; read over a connection of their own (the main thread's may be
        busy, or broken by the failure being diagnosed)."""
        try:
            store = self.store.connect_again(2 * self.window_s)
            try:
                return [store.add(self._key(r), 0) for r in ranks]
            finally:
                store.close()
        except StoreError:
            return None

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Run one iteration's distributed work; a failure inside is re-raised as a
        `PeerFailure` naming the iteration and the ranks that stopped answering."""
        try:
            yield
        except PeerFailure:
            raise
        except RuntimeError as err:
            raise PeerFailure(
                f"rank {self.rank}, {iteration_name(iteration)}: {self.diagnose()}; this rank "
                f"failed with: {err}"
            ) from err

    def _key(self, rank: int) -> str:
        return f"{PREFIX}/{rank}"

    def _beat(self, conn: JobStore) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                conn.add(self._key(self.rank), 1)
            except StoreError:
                return  # the store is gone; `diagnose` reports its server
        conn.close()
