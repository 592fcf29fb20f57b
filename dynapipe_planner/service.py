"""Planning overlapped with training: planner processes work ahead of the executors.

DynaPipe plans every iteration on CPUs while the GPUs train on earlier ones (seed `dynapipe.txt`
§3, last paragraph), because planning one iteration can take longer than running it (§8.5: up to
12.9x, so it is spread over CPU cores). `PlanningService` is that planner side: `num_workers`
processes keep the next `lookahead` iterations of a work source planned, and the training loop
asks for each iteration's plan with `get`. Moving plans to the other ranks (the instruction store
of §3 and §7) is the runtime's job: `megatron.dynapipe.pipeline.plan_distribution`.

Design choices and why:

- Workers are `multiprocessing` processes started with "spawn", never "fork": the training
  process runs torch, gloo and OpenMP threads, and a forked child could inherit a lock some
  thread held. Each worker rebuilds the same `IterationPlanner` from a picklable
  `PlannerRecipe`. Spawn normally re-imports the launching script in every child, which for a
  training script means torch and megatron-core: 3-9 s and 430 MB per worker on a 2-core
  machine, against 0.1-0.3 s and 32 MB without. Workers need nothing from that script
  (their code and recipe live in importable modules), so `__main__` is hidden from spawn while
  they start, unless the recipe pickles a reference to it. Workers start in parallel when the
  service is built, so their startup overlaps model setup.
- Work goes out through one shared queue, so whichever worker is free takes the next iteration;
  results are keyed by iteration, so `get(n)` returns iteration n's plan however the workers
  finish. Plans travel as `ExecutionPlan.to_bytes()`, ready to publish without re-encoding.
  Keys count from 0; messages name key n "iteration n+1", as the progress lines count.
- A late plan never hangs silently: `get` logs "waiting for plan of iteration n+1 (planner
  busy/late, ...)" every `log_interval_s` and raises `PlanTimeoutError` naming the iteration
  after `timeout_s`. A worker's `PlanningError` is re-raised for the iteration it concerns; a
  dead worker breaks the service with an error naming what it was planning.
- No orphans: each worker holds the read end of a pipe whose only writer is the parent. When
  the parent ends, however it ends (SIGKILL included), the worker reads end-of-file and exits;
  `close()` (or leaving the `with` block) terminates the workers at once.

Determinism: a plan is a function of the recipe and the work item, the same for any number of
workers or finishing order, except `stats["planning_time_s"]` (wall time): the DP's budget
(`PlannerConfig.dp_work_budget`) counts work, not seconds, so a busy CPU plans the same.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import NamedTuple, Protocol

import numpy as np

from .errors import PlanningError, PlanningServiceError, PlanTimeoutError, iteration_name
from .plan import ExecutionPlan
from .planner import CostModel, IterationPlanner, PlannerConfig
from .processes import main_hidden

_log = logging.getLogger(__name__)


class WorkItem(NamedTuple):
    """One iteration's global batch: sample lengths and their dataset ids."""

    iteration: int
    lengths: np.ndarray
    sample_ids: np.ndarray


class Planner(Protocol):
    """What a worker runs: one plan per global batch (an `IterationPlanner`, or the Hydraulis
    `StrategySelector` for heterogeneous plans)."""

    def plan(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> ExecutionPlan: ...


class Recipe(Protocol):
    """Picklable instructions for building the same `Planner` in every worker process."""

    def build(self) -> Planner: ...


@dataclass(frozen=True)
class PlannerRecipe:
    """What a worker process needs to build the caller's `IterationPlanner` (must pickle)."""

    cost_model: CostModel
    num_stages: int
    config: PlannerConfig = field(default_factory=PlannerConfig)

    @classmethod
    def of(cls, planner: IterationPlanner) -> PlannerRecipe:
        return cls(planner.cost_model, planner.num_stages, planner.config)

    def build(self) -> IterationPlanner:
        return IterationPlanner(self.cost_model, self.num_stages, self.config)


@dataclass(frozen=True)
class PlannedIteration:
    """One iteration's plan in binary form, with how long it took to make and to wait for."""

    iteration: int
    data: bytes
    planning_s: float
    waited_s: float = 0.0

    def plan(self) -> ExecutionPlan:
        return ExecutionPlan.from_bytes(self.data, f"plan of {iteration_name(self.iteration)}")


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    started: float
    startup_s: float | None = None
    planning: int | None = None  # iteration in progress
    planning_since: float = 0.0


class PlanningService:
    """Plans the iterations of `work` ahead of the caller and hands them out by iteration.

    `work` yields `WorkItem`s (or `(iteration, lengths, sample_ids)` tuples) with increasing
    iteration numbers; it is read in the caller's thread. At most `lookahead` plans that `get`
    has not returned yet are queued, in progress or done, besides the one `get` waits for.
    `num_workers=0` plans inline inside `get` (tests, debugging; `timeout_s` cannot apply).
    Each plan is returned once.
    """

    def __init__(
        self,
        recipe: Recipe,
        work: Iterable[WorkItem | tuple[int, np.ndarray, np.ndarray]],
        *,
        num_workers: int = 1,
        lookahead: int = 2,
        timeout_s: float = 600.0,
        log_interval_s: float = 10.0,
        logger: logging.Logger | None = None,
    ) -> None:
        if num_workers < 0 or lookahead < 0 or log_interval_s <= 0:
            raise PlanningServiceError(
                f"num_workers and lookahead must be >= 0 and log_interval_s > 0, got "
                f"{num_workers}, {lookahead} and {log_interval_s}"
            )
        self.num_workers, self.lookahead = num_workers, lookahead
        self.timeout_s, self.log_interval_s = timeout_s, log_interval_s
        self._log = logger or _log
        self._source = iter(work)
        self._exhausted = False
        self._last_read: int | None = None
        self._unplanned: dict[int, WorkItem] = {}  # inline mode: read, not yet asked for
        self._outstanding: set[int] = set()  # worker mode: submitted, no result yet
        self._results: dict[int, PlannedIteration | Exception] = {}
        self._workers: list[_Worker] = []
        self._broken: str | None = None
        self._closed = False
        self._planner = recipe.build()  # also checks the recipe before any worker starts
        if num_workers == 0:
            return
        try:
            needs_main = b"__main__" in pickle.dumps(recipe)
        except Exception as e:
            raise PlanningServiceError(
                f"planner recipe must pickle for worker processes: {e}"
            ) from e
        ctx = mp.get_context("spawn")
        self._tasks = ctx.Queue()
        try:
            with contextlib.nullcontext() if needs_main else main_hidden():
                self._start_workers(ctx, recipe)
            self._top_up()
        except BaseException:
            self.close()
            raise

    def _start_workers(self, ctx: mp.context.SpawnContext, recipe: Recipe) -> None:
        for index in range(self.num_workers):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(recipe, self._tasks, child_end),
                name=f"dynapipe-planner-{index}",
                daemon=True,
            )
            proc.start()
            child_end.close()  # the worker's copy must be the only one (end-of-file on exit)
            self._workers.append(_Worker(proc, parent_end, time.monotonic()))

    # ---- public ------------------------------------------------------------------------
    def get(self, iteration: int, timeout_s: float | None = None) -> ExecutionPlan:
        """The plan of `iteration`, waiting for it at most `timeout_s` (default: the service's)."""
        return self.get_planned(iteration, timeout_s).plan()

    def get_planned(self, iteration: int, timeout_s: float | None = None) -> PlannedIteration:
        """Like `get`, but the plan stays in binary form and comes with its timings."""
        if self._closed:
            raise PlanningServiceError(
                f"cannot get {iteration_name(iteration)}: the service is closed"
            )
        self._read_until(iteration)
        if self.num_workers == 0:
            return self._plan_inline(iteration)
        started = time.monotonic()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = started + timeout
        next_log = started + self.log_interval_s
        self._receive(0)  # what has arrived already, so that timeout_s=0 asks "is it ready?"
        while iteration not in self._results:
            self._check_workers(iteration)
            now = time.monotonic()
            if now >= deadline:
                raise PlanTimeoutError(
                    f"plan of {iteration_name(iteration)} not ready after {now - started:.1f} s "
                    f"({self._progress()}); planning is slower than training: add planner "
                    f"workers, raise the lookahead or the timeout, or lower the DP work budget"
                )
            if now >= next_log:
                self._log.warning(
                    "waiting for plan of %s (planner busy/late, %.1f s so far; %s)",
                    iteration_name(iteration),
                    now - started,
                    self._progress(),
                )
                next_log += self.log_interval_s
            self._receive(min(deadline, next_log) - now)
        result = self._results.pop(iteration)
        self._top_up()
        if isinstance(result, Exception):
            raise result
        return replace(result, waited_s=time.monotonic() - started)

    @property
    def worker_startup_s(self) -> list[float | None]:
        """Seconds from start until each worker could plan (None: not ready when last looked)."""
        return [w.startup_s for w in self._workers]

    @property
    def worker_pids(self) -> list[int | None]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers now (plans in progress are dropped); safe to call twice."""
        self._closed = True
        for w in self._workers:
            w.conn.close()
            if w.process.is_alive():
                w.process.terminate()
        for w in self._workers:
            w.process.join(timeout=5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        if self._workers:
            # Tasks still buffered for dead workers must not block interpreter exit.
            self._tasks.cancel_join_thread()
            self._tasks.close()

    def __enter__(self) -> PlanningService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- work source -------------------------------------------------------------------
    def _read_next(self) -> None:
        try:
            item = WorkItem(*next(self._source))
        except StopIteration:
            self._exhausted = True
            return
        it = int(item.iteration)
        if self._last_read is not None and it <= self._last_read:
            raise PlanningServiceError(
                f"work source gave {iteration_name(it)} after {iteration_name(self._last_read)}; "
                "iterations must increase"
            )
        self._last_read = it
        lengths = np.asarray(item.lengths)
        ids = np.arange(len(lengths)) if item.sample_ids is None else np.asarray(item.sample_ids)
        if self.num_workers == 0:
            self._unplanned[it] = WorkItem(it, lengths, ids)
        else:
            self._tasks.put((it, lengths, ids))
            self._outstanding.add(it)

    def _read_until(self, iteration: int) -> None:
        while not self._exhausted and (self._last_read is None or self._last_read < iteration):
            self._read_next()
        known = self._unplanned if self.num_workers == 0 else self._outstanding
        if iteration in known or iteration in self._results:
            return
        if self._exhausted and (self._last_read is None or self._last_read < iteration):
            raise PlanningServiceError(
                f"no plan for {iteration_name(iteration)}: the work source ended "
                + (
                    "before its first item"
                    if self._last_read is None
                    else f"at {iteration_name(self._last_read)}"
                )
            )
        raise PlanningServiceError(
            f"no plan for {iteration_name(iteration)}: it was already taken or the work source "
            "skipped it"
        )

    def _top_up(self) -> None:
        while (
            not self._exhausted
            and not self._broken
            and len(self._outstanding) + len(self._results) < self.lookahead
        ):
            self._read_next()

    # ---- inline mode -------------------------------------------------------------------
    def _plan_inline(self, iteration: int) -> PlannedIteration:
        item = self._unplanned.pop(iteration)
        started = time.perf_counter()
        try:
            data = self._planner.plan(item.lengths, item.sample_ids).to_bytes()
        except PlanningError as e:
            raise PlanningError(f"{iteration_name(iteration)}: {e}") from e
        spent = time.perf_counter() - started
        return PlannedIteration(iteration, data, spent, spent)

    # ---- worker mode -------------------------------------------------------------------
    def _receive(self, timeout: float) -> None:
        """Handle whatever the workers sent, waiting up to `timeout` for the first message
        (or a worker's exit)."""
        live = [w for w in self._workers if not w.conn.closed]
        sentinels = [w.process.sentinel for w in self._workers]
        ready = wait([w.conn for w in live] + sentinels, max(0.0, timeout))
        for w in live:
            if w.conn not in ready:
                continue
            try:
                while w.conn.poll():
                    self._handle(w, w.conn.recv())
            except (EOFError, OSError):
                w.conn.close()  # the worker ended; _check_workers reports it

    def _handle(self, w: _Worker, msg: tuple) -> None:
        kind, iteration, payload = msg
        now = time.monotonic()
        if kind == "ready":
            w.startup_s = now - w.started
        elif kind == "start":
            w.planning, w.planning_since = iteration, now
        else:
            w.planning = None
            self._outstanding.discard(iteration)
            if kind == "done":
                data, planning_s = payload
                self._results[iteration] = PlannedIteration(iteration, data, planning_s)
            elif kind == "invalid":
                self._results[iteration] = PlanningError(f"{iteration_name(iteration)}: {payload}")
            else:
                self._results[iteration] = PlanningServiceError(
                    f"planner worker {w.process.name} failed on {iteration_name(iteration)}:\n"
                    + payload
                )

    def _check_workers(self, iteration: int) -> None:
        if self._broken is None:
            for w in self._workers:
                code = w.process.exitcode
                if code is None:
                    continue
                how = (
                    f"was killed by {signal.Signals(-code).name}"
                    if code < 0
                    else f"exited with code {code}"
                )
                doing = (
                    f"while planning {iteration_name(w.planning)}"
                    if w.planning is not None
                    else ("before it was ready" if w.startup_s is None else "while idle")
                )
                self._broken = (
                    f"planner worker {w.process.name} (pid {w.process.pid}) {how} {doing}"
                )
                break
        if self._broken is not None:
            raise PlanningServiceError(f"no plan for {iteration_name(iteration)}: {self._broken}")

    def _progress(self) -> str:
        busy = [
            f"{iteration_name(w.planning)} for {time.monotonic() - w.planning_since:.1f} s"
            for w in self._workers
            if w.planning is not None
        ]
        starting = sum(w.startup_s is None for w in self._workers)
        parts = [f"planning {', '.join(busy)}" if busy else "no plan in progress"]
        if starting:
            parts.append(f"{starting} of {len(self._workers)} workers still starting")
        return "; ".join(parts)


def _worker_main(recipe: Recipe, tasks: mp.Queue, conn: Connection) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(conn,), daemon=True).start()
    planner = recipe.build()
    conn.send(("ready", None, None))
    while True:
        iteration, lengths, ids = tasks.get()
        conn.send(("start", iteration, None))
        started = time.perf_counter()
        try:
            data = planner.plan(lengths, ids).to_bytes()
        except PlanningError as e:
            conn.send(("invalid", iteration, str(e)))
        except Exception:
            conn.send(("failed", iteration, traceback.format_exc()))
        else:
            conn.send(("done", iteration, (data, time.perf_counter() - started)))


def _exit_with_parent(conn: Connection) -> None:
    """The parent never writes to `conn`: a read returns only when the parent has gone."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os._exit(0)
