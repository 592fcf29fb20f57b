"""Plans reach every rank through the plan store, planned once on rank 0: all ranks get the
same bytes, read keys are deleted, and a plan that never comes fails within the timeout naming
the iteration and the planning rank. The store listens only on the job's address, and an entry
not sealed with the job's secret (forged, or replayed under another iteration's key) is refused.
A batch the planner refuses reaches every rank as the planner's own error.

Skipped when torch is not installed.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch")

from distributed import free_port, run_ranks
from test_service import RECIPE, comparable, work

from dynapipe_planner.errors import PlanningServiceError, PlanTimeoutError
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.service import PlanningService

SECRET = b"this job's plan-entry secret key"


def _fetch_all(rank: int, world: int, store_port: int) -> dict:
    import torch.distributed as dist

    from megatron.dynapipe.pipeline.plan_distribution import PlanChannel, open_plan_store

    store = open_plan_store(rank, secret=SECRET, host="127.0.0.1", port=store_port, timeout_s=30)
    service = PlanningService(RECIPE, work(3), num_workers=1) if rank == 0 else None
    try:
        channel = PlanChannel(store, rank, world, secret=SECRET, service=service, timeout_s=30)
        plans = [channel.fetch(i).to_bytes() for i in range(3)]
    finally:
        if service is not None:
            service.close()
    dist.barrier()  # every rank has read every plan
    left = [store.check([f"dynapipe/plan/{i}", f"dynapipe/plan/{i}/acks"]) for i in range(3)]
    dist.barrier()  # rank 0 serves the store: keep it up until all have looked
    return {"plans": plans, "keys_left": left}


def test_every_rank_gets_rank_0s_plans():
    results = run_ranks(_fetch_all, 3, free_port(), timeout_s=60)
    assert results[0]["plans"] == results[1]["plans"] == results[2]["plans"]
    with PlanningService(RECIPE, work(3), num_workers=0) as inline:
        expected = [comparable(inline.get(i)) for i in range(3)]
    assert [comparable(ExecutionPlan.from_bytes(p)) for p in results[0]["plans"]] == expected
    assert all(r["keys_left"] == [False, False, False] for r in results)


def _miss_a_plan(rank: int, world: int, store_port: int) -> dict:
    import time

    import torch.distributed as dist

    from megatron.dynapipe.pipeline.plan_distribution import PlanChannel, open_plan_store

    store = open_plan_store(rank, secret=SECRET, host="127.0.0.1", port=store_port, timeout_s=30)
    messages: list[str] = []
    logger = logging.getLogger(f"plan-channel-{rank}")
    logger.addHandler(_ListHandler(messages))
    channel = PlanChannel(
        store, rank, world, secret=SECRET, timeout_s=30, log_interval_s=0.2, logger=logger
    )
    if rank == 0:
        with PlanningService(RECIPE, work(1), num_workers=0) as inline:
            channel.publish(0, inline.get(0))
    channel.fetch(0)
    started, error = time.monotonic(), "no error"
    try:
        channel.fetch(1, timeout_s=0.7)
    except (PlanTimeoutError, PlanningServiceError) as e:
        error = f"{type(e).__name__}: {e}"
    spent = time.monotonic() - started
    dist.barrier()
    return {"error": error, "spent": spent, "log": messages}


class _ListHandler(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_missing_plan_fails_in_time_naming_the_iteration():
    results = run_ranks(_miss_a_plan, 3, free_port(), timeout_s=60)
    assert results[0]["error"].startswith(
        "PlanningServiceError: rank 0 has no plan for iteration 2"  # key 1, counted from 1
    )
    for r in results[1:]:
        assert r["error"].startswith("PlanTimeoutError: rank ")
        assert "no plan for iteration 2 after 0.7 s; rank 0 plans and publishes it" in r["error"]
        assert 0.6 < r["spent"] < 3
        assert any("waiting for plan of iteration 2 from rank 0" in m for m in r["log"])


class _RefusingService:
    """A planning service whose planner refuses the batch (the input's fault)."""

    def get_planned(self, iteration, timeout_s=None):
        from dynapipe_planner.errors import PlanningError

        raise PlanningError("iteration 1: no feasible plan (a model that fits nowhere)")


def _refused_plan(rank: int, world: int, store_port: int) -> dict:
    """Rank 0's planner refuses iteration 0; rank 0 raises and closes its store right away."""
    import time

    from dynapipe_planner.errors import PlanningError
    from megatron.dynapipe.pipeline.plan_distribution import PlanChannel, open_plan_store

    store = open_plan_store(rank, secret=SECRET, host="127.0.0.1", port=store_port, timeout_s=30)
    service = _RefusingService() if rank == 0 else None
    channel = PlanChannel(store, rank, world, secret=SECRET, service=service, timeout_s=20)
    if rank == 2:
        time.sleep(1.0)  # a slow reader: the planning rank must still be serving the refusal
    try:
        channel.fetch(0)
    except PlanningError as e:  # PlanningServiceError would be a fault, not the input's
        error = f"{type(e).__name__}: {e}"
    if rank == 0:
        left = store.check(["dynapipe/plan/0"])
        store.close()  # the planning rank exits: its store server goes away
        return {"error": error, "left": left}
    return {"error": error}


def test_a_refused_batch_reaches_every_rank_as_the_planners_error():
    results = run_ranks(_refused_plan, 3, free_port(), timeout_s=60)
    expected = "PlanningError: iteration 1: no feasible plan (a model that fits nowhere)"
    assert [r["error"] for r in results] == [expected] * 3
    assert results[0]["left"] is False  # it waited until the last reader took the refusal


class _StoreThatDiesOnRead:
    """A plan store whose server (the planning rank) goes away after announcing the plan."""

    def wait(self, keys, timeout) -> None:
        return None

    def get(self, key):
        from megatron.dynapipe.pipeline.job_store import StoreUnreachable

        raise StoreUnreachable(f"Connection reset by peer while reading {key}")


def test_a_store_lost_while_reading_names_the_planner_and_iteration():
    from megatron.dynapipe.pipeline.plan_distribution import PlanChannel

    channel = PlanChannel(_StoreThatDiesOnRead(), 2, 3, secret=SECRET, timeout_s=5)
    with pytest.raises(PlanningServiceError) as raised:
        channel.fetch(7)
    message = str(raised.value)
    assert message.startswith("rank 2: lost the plan store of rank 0 (the planner)")
    assert "while reading the plan of iteration 8" in message  # key 7, counted from 1
    assert "Connection reset by peer while reading dynapipe/plan/7" in message


def _forged_and_replayed(rank: int, world: int, store_port: int) -> dict:
    """Rank 0 publishes iteration 0; then bytes sealed without the secret (what a writer on the
    wire could inject) arrive at iteration 1's key, and iteration 0's sealed entry is replayed
    at iteration 2's key. A stranger without the secret cannot connect at all."""
    import psutil
    import torch.distributed as dist

    from megatron.dynapipe.pipeline.job_store import JobStore, StoreUnreachable
    from megatron.dynapipe.pipeline.plan_distribution import PlanChannel, open_plan_store

    store = open_plan_store(rank, secret=SECRET, host="127.0.0.1", port=store_port, timeout_s=30)
    channel = PlanChannel(store, rank, world, secret=SECRET, timeout_s=10)
    with PlanningService(RECIPE, work(1), num_workers=0) as inline:
        plan = inline.get(0)
    if rank == 0:
        channel.publish(0, plan)
        sealed = store.get("dynapipe/plan/0")
        intruder = PlanChannel(store, 0, world, secret=b"a guess at the job secret", timeout_s=5)
        intruder.publish(1, plan)  # a well-formed plan, sealed with the wrong key
        store.set("dynapipe/plan/2", sealed)
        try:  # a stranger, without the secret, cannot even connect
            JobStore("127.0.0.1", store_port, b"a guess at the job secret", timeout_s=5)
            stranger = "connected"
        except StoreUnreachable as e:
            stranger = str(e)
    dist.barrier()
    outcomes = {}
    for iteration in (0, 1, 2) if rank else ():
        try:
            channel.fetch(iteration)
            outcomes[iteration] = "ran"
        except PlanningServiceError as e:
            outcomes[iteration] = str(e)
    listening = sorted(
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store_port
    )
    dist.barrier()
    return {"outcomes": outcomes, "listening": listening, "stranger": stranger if rank == 0 else ""}


def test_forged_and_replayed_plans_are_refused_and_the_store_listens_on_the_job_address():
    port = free_port()
    server, reader = run_ranks(_forged_and_replayed, 2, port, timeout_s=60)
    assert server["listening"] == ["127.0.0.1"]
    assert "did not complete its handshake" in server["stranger"]
    assert reader["outcomes"][0] == "ran"
    for iteration in (1, 2):
        refused = reader["outcomes"][iteration]
        assert refused.startswith(f"rank 1: plan store entry 'dynapipe/plan/{iteration}' fails ")
        assert "refusing to run it" in refused


def test_a_store_on_every_interface_is_warned_about(capfd) -> None:
    """Issue 34: MASTER_ADDR 0.0.0.0 binds the plan store on every interface: one warning."""
    from megatron.dynapipe.pipeline.plan_distribution import open_plan_store

    open_plan_store(0, secret=SECRET, host="0.0.0.0", port=free_port(), timeout_s=5).close()
    err = capfd.readouterr().err
    assert "warning: MASTER_ADDR 0.0.0.0 makes the plan store listen on every network" in err
    open_plan_store(0, secret=SECRET, host="127.0.0.1", port=free_port(), timeout_s=5).close()
    assert "warning" not in capfd.readouterr().err
