"""The simulator against hand-built plans: exact 1F1B makespans, the communication-order rules of
dynapipe.txt §2.3/§6, every plan check, peak memory, and the trace and PNG writers."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.cost.table import PipelineCosts
from dynapipe_planner.errors import CommMismatchError, DeadlockError, PlanCheckError
from dynapipe_planner.plan import WAIT_FOR_START, ExecutionPlan, Instruction, MicroBatch, RankPlan
from dynapipe_planner.simulate import PARTNER, simulate, verify_plan
from dynapipe_planner.trace import write_chrome_trace, write_timeline_png

F, B = "F", "B"
DTYPE = "bf16"
Op = tuple[str, int]


# ---- builders ---------------------------------------------------------------------------------


def make_costs(
    num_stages: int,
    forward: float | list[float] = 1.0,
    backward: float | list[float] = 2.0,
    *,
    activation: float = 0.0,
    transient: float = 0.0,
    static: float = 0.0,
    latency: float = 0.0,
    memory_limit: float = math.inf,
    per_token: bool = False,
) -> PipelineCosts:
    """Tables constant in b; with `per_token` the time grows linearly with seqlen.
    Infinite bandwidth makes every transfer take exactly `latency` seconds."""

    def table(value: float | list[float], scale_s: bool = False) -> np.ndarray:
        per_stage = np.broadcast_to(np.asarray(value, dtype=float), (num_stages,))
        out = np.repeat(per_stage.reshape(-1, 1, 1, 1), 2, axis=1).repeat(2, axis=2)
        if scale_s:
            out[:, :, 1, :] *= 4096
        return out

    return PipelineCosts(
        b_grid=np.array([1, 64]),
        s_grid=np.array([1, 4096]),
        t_grid=np.array([0]),
        forward=table(forward, per_token),
        backward=table(backward, per_token),
        activation=table(activation),
        transient=table(transient),
        static=np.full(num_stages, float(static)),
        attention_coef=np.zeros(num_stages),
        hidden_size=8,
        memory_limit=memory_limit,
        p2p_bandwidth=np.full(num_stages - 1, np.inf),
        p2p_latency=latency,
    )


def microbatches(num: int, replica: int = 0, first_id: int = 0, seqlens=None) -> list[MicroBatch]:
    seqlens = seqlens or [128] * num
    return [MicroBatch(first_id + i, replica, [0, 1], seqlens[i]) for i in range(num)]


def one_f_one_b(num_stages: int, num_mbs: int, stage: int, warmup: int | None = None) -> list[Op]:
    """Compute order of `stage`: `warmup` forwards, then one forward one backward, then drain."""
    if warmup is None:
        warmup = num_stages - stage - 1
    warmup = min(warmup, num_mbs)
    order = [(F, m) for m in range(warmup)]
    for m in range(num_mbs - warmup):
        order += [(F, m + warmup), (B, m)]
    return order + [(B, m) for m in range(num_mbs - warmup, num_mbs)]


def shape_of(costs: PipelineCosts, mb: MicroBatch, stage_a: int, stage_b: int) -> tuple[int, ...]:
    boundary = min(stage_a, stage_b)
    return tuple(costs.boundary_shape(boundary, len(mb.samples), mb.seqlen, mb.tgt_seqlen))


def list_schedule(orders: list[list[Op]], mbs: dict[int, MicroBatch], costs: PipelineCosts):
    """Compute timeline of per-stage orders with transfers that never queue: a reference the
    simulator must reproduce when transfers cannot collide. Returns (end, stage, kind, mb, start)
    sorted by end time, or None when the orders depend on each other in a cycle."""
    num_stages = len(orders)
    ends: dict[tuple[int, str, int], float] = {}
    free, pos, done = [0.0] * num_stages, [0] * num_stages, []
    progress = True
    while progress:
        progress = False
        for j in range(num_stages):
            while pos[j] < len(orders[j]):
                kind, m = orders[j][pos[j]]
                src = j - 1 if kind == F else j + 1
                ready = 0.0
                if 0 <= src < num_stages:
                    if (src, kind, m) not in ends:
                        break
                    shape = list(shape_of(costs, mbs[m], j, src))
                    ready = ends[(src, kind, m)] + costs.p2p_time(min(j, src), shape)
                c = costs.stage_costs(len(mbs[m].samples), mbs[m].seqlen)
                start = max(free[j], ready)
                free[j] = ends[(j, kind, m)] = start + float(
                    (c.forward if kind == F else c.backward)[j]
                )
                done.append((free[j], j, kind, m, start))
                pos[j] += 1
                progress = True
    if any(pos[j] < len(orders[j]) for j in range(num_stages)):
        return None
    return sorted(done)


def rank_programs(
    orders: list[list[Op]],
    mbs: list[MicroBatch],
    costs: PipelineCosts,
    replica: int = 0,
    naive: bool = False,
) -> list[RankPlan]:
    """Instruction lists for per-stage compute orders. Planned (§6): both Starts of a transfer
    are posted when the tensor is produced, in order of production time; naive (§2.3): the send
    when produced, the receive just before the tensor is used. Sends are waited for at the end."""
    by_id = {m.id: m for m in mbs}
    num_stages = len(orders)
    programs: list[list[Instruction]] = [[] for _ in range(num_stages)]
    send_waits: list[list[Instruction]] = [[] for _ in range(num_stages)]
    schedule = list_schedule(orders, by_id, costs)
    assert schedule is not None, "compute orders with a cyclic dependency"
    for _end, j, kind, m, _start in schedule:
        src, dst = (j - 1, j + 1) if kind == F else (j + 1, j - 1)
        if 0 <= src < num_stages:
            recv = "RecvActStart" if kind == F else "RecvGradStart"
            if naive:
                programs[j].append(
                    Instruction(recv, m, src, shape_of(costs, by_id[m], j, src), DTYPE)
                )
            programs[j].append(Instruction(WAIT_FOR_START[recv], m, src))
        elif kind == F:
            programs[j].append(Instruction("LoadBatch", m))
        programs[j].append(Instruction("ForwardPass" if kind == F else "BackwardPass", m))
        if 0 <= dst < num_stages:
            send = "SendActStart" if kind == F else "SendGradStart"
            shape = shape_of(costs, by_id[m], j, dst)
            programs[j].append(Instruction(send, m, dst, shape, DTYPE))
            if not naive:
                programs[dst].append(Instruction(PARTNER[send], m, j, shape, DTYPE))
            send_waits[j].append(Instruction(WAIT_FOR_START[send], m, dst))
        if kind == B:
            programs[j].append(Instruction("FreeBuffer", m))
    return [RankPlan(replica, j, programs[j] + send_waits[j]) for j in range(num_stages)]


def make_plan(
    orders_per_replica: list[list[list[Op]]],
    mbs: list[MicroBatch],
    costs: PipelineCosts,
    naive: bool = False,
) -> ExecutionPlan:
    ranks = []
    for replica, orders in enumerate(orders_per_replica):
        own = [m for m in mbs if m.replica == replica]
        ranks += rank_programs(orders, own, costs, replica, naive)
    return ExecutionPlan(len(orders_per_replica[0]), len(orders_per_replica), mbs, ranks)


def plan_1f1b(num_stages: int, num_mbs: int, costs: PipelineCosts) -> ExecutionPlan:
    orders = [one_f_one_b(num_stages, num_mbs, j) for j in range(num_stages)]
    return make_plan([orders], microbatches(num_mbs), costs)


def edit(plan: ExecutionPlan, stage: int, change) -> ExecutionPlan:
    """The plan with `change(instructions)` applied to replica 0's `stage`."""
    plan.rank_plan(0, stage).instructions = change(list(plan.rank_plan(0, stage).instructions))
    return plan


def index_of(instructions: list[Instruction], op: str, mb: int) -> int:
    return next(i for i, ins in enumerate(instructions) if ins.op == op and ins.mb == mb)


def without(op: str, mb: int):
    return lambda instrs: [ins for ins in instrs if not (ins.op == op and ins.mb == mb)]


# ---- timing -----------------------------------------------------------------------------------


@settings(max_examples=examples(40), deadline=None)
@given(
    num_stages=st.integers(1, 5),
    num_mbs=st.integers(1, 8),
    f=st.integers(1, 5),
    b=st.integers(1, 5),
)
def test_1f1b_without_transfer_time_takes_m_plus_c_minus_1_slots(num_stages, num_mbs, f, b):
    costs = make_costs(num_stages, f, b)
    result = simulate(plan_1f1b(num_stages, num_mbs, costs), costs)
    assert result.makespan == (num_mbs + num_stages - 1) * (f + b)
    assert all(busy == num_mbs * (f + b) for busy in result.busy.values())
    assert result.bubble_fraction == pytest.approx((num_stages - 1) / (num_mbs + num_stages - 1))


def one_f_one_b_makespan(c: int, m: int, f: float, b: float, tau: float) -> float:
    """1F1B with C equal stages and transfers of `tau` seconds. On top of the (M+C-1)(f+b) of a
    latency-free pipeline, micro-batch 0 crosses 2(C-1) links before stage 0 runs its first
    backward; later, each backward on stage 0 waits for a round trip over 2(C-1) links that the
    C-1 forward/backward pairs it runs meanwhile do not fully cover, which costs 2 tau for every
    C/(C-1) micro-batches. By hand for C=2, M=3 (f, b, tau written F, B, t): stage 0 runs B0 at
    2F+B+2t, F2, B1 at 3F+2B+2t, then waits for B2's gradient, which stage 1 sends at 4F+3B+3t
    (its F2 waited for act2 until 3F+2B+3t): the end is 4(F+B)+4t. The tests also compare with
    `list_schedule`, which knows nothing of channels."""
    return (m + c - 1) * (f + b) + 2 * tau * ((c - 1) + (m - 1) * (c - 1) // c)


@pytest.mark.parametrize(("num_stages", "num_mbs"), [(2, 3), (2, 6), (4, 4), (4, 8)])
def test_1f1b_with_transfer_time_exact_makespan(num_stages, num_mbs):
    costs = make_costs(num_stages, 3.0, 5.0, latency=0.25)
    plan = plan_1f1b(num_stages, num_mbs, costs)
    result = simulate(plan, costs)
    assert result.makespan == pytest.approx(one_f_one_b_makespan(num_stages, num_mbs, 3, 5, 0.25))
    orders = [one_f_one_b(num_stages, num_mbs, j) for j in range(num_stages)]
    reference = list_schedule(orders, {m.id: m for m in plan.microbatches}, costs)
    assert result.makespan == pytest.approx(max(end for end, *_ in reference))
    assert len(result.transfer_events) == 2 * (num_stages - 1) * num_mbs
    assert all(e.end - e.start == pytest.approx(0.25) for e in result.transfer_events)


@settings(max_examples=examples(40), deadline=None)
@given(
    num_stages=st.sampled_from([2, 4]),
    num_mbs=st.integers(1, 9),
    f=st.integers(1, 6),
    b=st.integers(1, 6),
    tau=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
)
def test_1f1b_makespan_formula(num_stages, num_mbs, f, b, tau):
    costs = make_costs(num_stages, f, b, latency=tau)
    result = simulate(plan_1f1b(num_stages, num_mbs, costs), costs)
    assert result.makespan == pytest.approx(one_f_one_b_makespan(num_stages, num_mbs, f, b, tau))


@st.composite
def skewed_pipelines(draw):
    """1F1B-like orders with random warmup depths (never deeper on a later stage, so the orders
    are acyclic), micro-batches of random length and per-stage speeds."""
    num_stages = draw(st.integers(2, 4))
    num_mbs = draw(st.integers(1, 7))
    depths = draw(st.lists(st.integers(0, num_mbs), min_size=num_stages, max_size=num_stages))
    warmups = [*sorted(depths, reverse=True)[:-1], 0]
    seqlens = draw(st.lists(st.integers(16, 4096), min_size=num_mbs, max_size=num_mbs))
    speeds = draw(st.lists(st.floats(0.5, 2.0), min_size=num_stages, max_size=num_stages))
    orders = [one_f_one_b(num_stages, num_mbs, j, w) for j, w in enumerate(warmups)]
    return orders, microbatches(num_mbs, seqlens=seqlens), speeds


@settings(max_examples=examples(60), deadline=None)
@given(pipeline=skewed_pipelines(), tau=st.sampled_from([0.0, 1e-4, 3e-3]))
def test_planned_communication_never_deadlocks(pipeline, tau):
    """§6: posting both sides of each transfer at production time is deadlock-free for any
    acyclic compute orders. With instant transfers nothing can queue on a channel, so the
    simulator must reproduce the reference list schedule exactly."""
    orders, mbs, speeds = pipeline
    fwd = [1e-6 * s for s in speeds]
    costs = make_costs(len(orders), fwd, [2 * x for x in fwd], latency=tau, per_token=True)
    result = simulate(make_plan([orders], mbs, costs), costs)
    by_rank: dict = {}
    for e in result.compute_events:
        by_rank.setdefault(e.rank, []).append(e)
    for events in by_rank.values():
        assert all(a.end <= b.start for a, b in itertools.pairwise(events))
    links: dict = {}
    for e in result.transfer_events:
        links.setdefault(min(e.rank[1], e.peer), []).append(e)
    for events in links.values():
        assert all(a.end <= b.start for a, b in itertools.pairwise(events))
    assert result.makespan >= max(result.busy.values())
    if tau == 0.0:
        reference = list_schedule(orders, {m.id: m for m in mbs}, costs)
        assert result.makespan == max(end for end, *_ in reference)
        starts = sorted((s, (0, j), k, m) for _, j, k, m, s in reference)
        assert starts == sorted((e.start, e.rank, e.kind, e.mb) for e in result.compute_events)


def test_replicas_run_independently():
    costs = make_costs(2, 1.0, 2.0, latency=0.5)
    orders = [one_f_one_b(2, 3, j) for j in range(2)]
    shifted = [[(kind, m + 3) for kind, m in order] for order in orders]
    mbs = microbatches(3) + microbatches(3, replica=1, first_id=3)
    both = simulate(make_plan([orders, shifted], mbs, costs), costs)
    alone = simulate(plan_1f1b(2, 3, costs), costs)
    assert both.makespan == alone.makespan
    assert both.ranks == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert both.busy[(1, 1)] == alone.busy[(0, 1)]


# ---- communication order ----------------------------------------------------------------------

FIG_8B_ORDERS = [
    [(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)],
    [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)],
]


def test_naive_send_when_produced_order_fails():
    """Fig. 8b: stage 0 posts the activation of mb 1 while stage 1 posts the gradient of mb 0."""
    costs = make_costs(2, latency=0.1)
    plan = make_plan([FIG_8B_ORDERS], microbatches(3), costs, naive=True)
    with pytest.raises((DeadlockError, CommMismatchError)) as err:
        simulate(plan, costs)
    assert "SendActStart mb 1" in str(err.value)
    assert "SendGradStart mb 0" in str(err.value)


def test_planned_order_of_the_same_schedule_runs():
    costs = make_costs(2, latency=0.1)
    result = simulate(make_plan([FIG_8B_ORDERS], microbatches(3), costs), costs)
    assert len(result.compute_events) == 12


def test_verify_plan_needs_no_cost_model():
    """The runtime's pre-flight check decides the same contract without any costs."""
    costs = make_costs(2, latency=0.1)
    verify_plan(make_plan([FIG_8B_ORDERS], microbatches(3), costs))
    naive = make_plan([FIG_8B_ORDERS], microbatches(3), costs, naive=True)
    with pytest.raises((DeadlockError, CommMismatchError), match="SendActStart mb 1"):
        verify_plan(naive)


def test_shape_mismatch_names_both_sides():
    costs = make_costs(2)
    plan = plan_1f1b(2, 2, costs)

    def reshape(instrs):
        i = index_of(instrs, "RecvActStart", 1)
        instrs[i] = Instruction("RecvActStart", 1, 0, (2, 64, 8), DTYPE)
        return instrs

    with pytest.raises(CommMismatchError) as err:
        simulate(edit(plan, 1, reshape), costs)
    message = str(err.value)
    sender = index_of(plan.rank_plan(0, 0).instructions, "SendActStart", 1)
    receiver = index_of(plan.rank_plan(0, 1).instructions, "RecvActStart", 1)
    assert f"rank (replica 0, stage 0) instruction {sender} (SendActStart mb 1)" in message
    assert f"rank (replica 0, stage 1) instruction {receiver} (RecvActStart mb 1)" in message
    assert "[2, 128, 8]" in message and "[2, 64, 8]" in message


def test_transfer_the_peer_never_posts_deadlocks():
    """Stage 1 never sends the gradient of mb 1, so stage 0 waits for it forever."""
    costs = make_costs(2)
    plan = plan_1f1b(2, 2, costs)
    edit(plan, 1, without("SendGradStart", 1))
    edit(plan, 1, without("WaitSendGrad", 1))
    with pytest.raises(DeadlockError) as err:
        simulate(plan, costs)
    message = str(err.value)
    waiting = index_of(plan.rank_plan(0, 0).instructions, "WaitRecvGrad", 1)
    assert f"rank (replica 0, stage 0) instruction {waiting} (WaitRecvGrad mb 1)" in message
    assert "RecvGradStart mb 1" in message and "has finished" in message


# ---- plan checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "change", "expected"),
    [
        (1, without("WaitRecvAct", 1), "(ForwardPass mb 1): runs before the WaitRecvAct"),
        (0, without("WaitRecvGrad", 0), "(BackwardPass mb 0): runs before the WaitRecvGrad"),
        (0, without("BackwardPass", 1), "stage 0) has no BackwardPass of micro-batch(es) [1]"),
        (1, without("ForwardPass", 0), "(BackwardPass mb 0): runs before the ForwardPass"),
        (0, without("WaitSendAct", 0), "(SendActStart mb 0): this Start is never waited for"),
        (0, without("RecvGradStart", 0), "(WaitRecvGrad mb 0): a Wait without an earlier"),
        (0, without("SendActStart", 1), "(WaitSendAct mb 1): a Wait without an earlier"),
    ],
)
def test_broken_plans_are_rejected(stage, change, expected):
    costs = make_costs(2)
    with pytest.raises(PlanCheckError) as err:
        simulate(edit(plan_1f1b(2, 2, costs), stage, change), costs)
    assert expected in str(err.value)


def test_duplicate_forward_pass():
    costs = make_costs(2)

    def twice(instrs):
        i = index_of(instrs, "ForwardPass", 0)
        return [*instrs[: i + 1], Instruction("ForwardPass", 0), *instrs[i + 1 :]]

    plan = edit(plan_1f1b(2, 2, costs), 0, twice)
    with pytest.raises(PlanCheckError, match=r"instruction \d+ \(ForwardPass mb 0\): second"):
        simulate(plan, costs)


def test_send_before_the_pass_that_produces_it():
    costs = make_costs(2)

    def early(instrs):
        i = index_of(instrs, "SendActStart", 1)
        return [instrs[i], *instrs[:i], *instrs[i + 1 :]]

    with pytest.raises(PlanCheckError, match="before the ForwardPass that produces it"):
        simulate(edit(plan_1f1b(2, 2, costs), 0, early), costs)


# ---- memory -----------------------------------------------------------------------------------

GIB = 2**30


def test_peak_memory_matches_hand_count():
    """1F1B holds C - j activations on stage j (for M >= C), plus the transient of the running
    pass on top of the static bytes."""
    costs = make_costs(4, activation=3 * GIB, transient=GIB, static=10 * GIB)
    result = simulate(plan_1f1b(4, 6, costs), costs)
    for j in range(4):
        assert result.peak_memory[(0, j)] == 10 * GIB + (4 - j) * 3 * GIB + GIB


def test_memory_above_the_limit_is_reported_with_numbers():
    peak_stage_0 = 10 * GIB + 4 * 3 * GIB + GIB
    limit = peak_stage_0 - 1
    costs = make_costs(4, activation=3 * GIB, transient=GIB, static=10 * GIB, memory_limit=limit)
    plan = plan_1f1b(4, 6, costs)
    with pytest.raises(PlanCheckError) as err:
        simulate(plan, costs)
    message = str(err.value)
    assert "rank (replica 0, stage 0)" in message and "(ForwardPass mb 3)" in message
    assert f"{peak_stage_0} bytes" in message and f"limit of {limit} bytes" in message
    assert simulate(plan, costs, check_memory=False).peak_memory[(0, 0)] == peak_stage_0


def test_infeasible_microbatch_is_reported():
    costs = make_costs(2)
    plan = plan_1f1b(2, 2, costs)
    plan.microbatches[1].seqlen = 8192
    with pytest.raises(PlanCheckError, match=r"micro-batch 1 .* beyond the cost tables"):
        simulate(plan, costs)


# ---- outputs and speed ------------------------------------------------------------------------


def test_summary_is_json_ready():
    costs = make_costs(2, latency=0.5)
    summary = simulate(plan_1f1b(2, 3, costs), costs).summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["num_compute_events"] == 12 and len(summary["ranks"]) == 2
    assert summary["ranks"][0]["idle_s"] == summary["makespan_s"] - summary["ranks"][0]["busy_s"]


def test_chrome_trace_has_one_complete_event_per_compute_op(tmp_path):
    costs = make_costs(3, latency=0.01)
    result = simulate(plan_1f1b(3, 4, costs), costs)
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    events = json.loads(path.read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    transfers = [e for e in events if e["ph"] == "X" and e["cat"] == "p2p"]
    assert len(compute) == 2 * 3 * 4 and len(transfers) == 2 * 2 * 4
    assert {e["name"] for e in compute if e["tid"] == 0} == {
        f"{k}{m}" for k in "FB" for m in range(4)
    }
    first = min(compute, key=lambda e: e["ts"])
    assert first["ts"] == 0 and first["dur"] == pytest.approx(1e6)
    assert {e["tid"] for e in transfers} == {3, 4}
    assert any(e["ph"] == "M" and e["args"].get("name") == "stage 2" for e in events)


def test_timeline_png(tmp_path):
    costs = make_costs(2)
    path = tmp_path / "timeline.png"
    write_timeline_png(simulate(plan_1f1b(2, 4, costs), costs), path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]


def test_twenty_thousand_instructions_simulate_exactly():
    """A plan of a real job's size is simulated to the 1F1B formula's makespan. How fast is
    not a unit test's business: no test depends on machine load."""
    costs = make_costs(8, 1.0, 2.0, latency=0.125)
    plan = plan_1f1b(8, 250, costs)
    assert 19_000 <= sum(len(r.instructions) for r in plan.ranks) <= 21_000
    result = simulate(plan, costs)
    assert result.makespan == pytest.approx(one_f_one_b_makespan(8, 250, 1.0, 2.0, 0.125))
    assert len(result.transfer_events) == 2 * 7 * 250
