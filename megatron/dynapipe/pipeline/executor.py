"""Runs one rank's instruction list of an `ExecutionPlan` on a megatron-core model chunk.

This is DynaPipe's instruction-driven executor (seed `dynapipe.txt` §3): the planner decided
micro-batches, their order on every stage and where each transfer is posted; the executor does
exactly that and nothing else, so a plan the simulator proved deadlock-free runs as proven.

Before running, the model is switched to the recomputation mode the plan chose for this
rank's stage (`recompute.stage_mode`, §7 "Dynamic recomputation"). `LoadBatch` needs no
action: as in megatron-core, `forward_step_func` takes the micro-batch from its iterator.
`FreeBuffer` drops the activations a micro-batch held for its backward.

It stands where `megatron.core.pipeline_parallel.get_forward_backward_func()` stood: it calls the
same `forward_step_func(data_iterator, model) -> (output, loss_func)` on every stage, and at the
end the config's `finalize_model_grads_func` (DP gradient sync, tied-embedding sync) with the
iteration's real-token count. `loss_func(output)` must use Megatron's per-token form
`(loss_sum, num_tokens, report)`: the summed losses are back-propagated and the gradients are
divided once by the real tokens of the whole global batch, so micro-batches of any size weigh
each token equally (megatron's `calculate_per_token_loss`).

Heterogeneous plans (pipelines of different depth and TP per stage; seed `hexiscale.txt` §3.2)
run on a job whose groups were built from the same layouts
(`parallel_state.initialize_heterogeneous`): each rank runs its (replica, stage)'s list, its
stage boundaries go leader to leader with a TP broadcast (`p2p.LeaderPeerToPeer`) and the
config's finalize function is the asymmetric gradient sync (`layouts.grad_sync.AsymmetricGradSync`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from megatron.core.utils import get_attr_wrapped_model

from dynapipe_planner.plan import ExecutionPlan, Instruction, ReplicaLayout
from dynapipe_planner.simulate import verify_plan

from .. import parallel_state as ps
from ..device_speed import paced
from ..memory import release_megatron_workspace
from .p2p import PLAN_DTYPES, LeaderPeerToPeer, PeerToPeer, Transfer, packed_shape
from .recompute import RECOMPUTE_MODES, apply_recompute, stage_mode

ForwardStepFunc = Callable[[Iterator[Any], torch.nn.Module], tuple[torch.Tensor, Callable]]


_BACKWARD_OPS = frozenset(
    {"BackwardPass", "SendGradStart", "RecvGradStart", "WaitSendGrad", "WaitRecvGrad"}
)


def _read_when_asked(batches: Mapping[int, Any], mb: int) -> Iterator[Any]:
    """The data iterator a `forward_step` gets: micro-batch `mb`, built only if the program
    reads it. A Megatron-LM program reads it on tensor-parallel rank 0 only and broadcasts
    (`get_batch`); its dataset exists only there."""
    yield batches[mb]


def _is_backward(ins: Instruction) -> bool:
    """Backward passes and gradient transfers: what evaluation leaves out of a plan."""
    return ins.op in _BACKWARD_OPS


class PlanRejected(ValueError):
    """The plan does not fit this job or breaks the plan contract; nothing was run."""


def sequence_shards(config: Any) -> int:
    """How many tensor-parallel ranks split each micro-batch's sequence between stages: the TP
    degree under sequence parallelism (each rank holds its part of the activations, as
    megatron-core's layers leave them), else 1 (every TP rank holds the whole activation)."""
    if not getattr(config, "sequence_parallel", False):
        return 1
    return config.tensor_model_parallel_size


def masked_token_loss(
    loss_mask: torch.Tensor, per_token_loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's per-token loss form: (sum of real-token losses, real tokens, report)."""
    mask = loss_mask.to(per_token_loss.dtype)
    loss_sum = (per_token_loss.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int64)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.to(torch.float32)])
    return loss_sum, num_tokens, {"lm loss": report}


def gpt_forward_step(
    data_iterator: Iterator[Any], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable]:
    """Forward of one micro-batch of `data.microbatches` tensors through a GPTModel stage.

    Stages other than the first ignore the tokens (their input is the received activation) and
    stages other than the last ignore the labels, as in megatron-core. Every micro-batch runs as
    one THD sequence with its samples' boundaries (`data.microbatches`), without a mask.
    """
    device = next(model.parameters()).device
    batch = next(data_iterator).to(device)
    output = model(
        batch.tokens,
        batch.position_ids,
        None,
        labels=batch.labels,
        packed_seq_params=batch.packed_seq_params(device),
    )
    return output, partial(masked_token_loss, batch.loss_mask)


@dataclass
class _MicroBatchState:
    """Tensors one micro-batch holds on this rank between its instructions."""

    input: torch.Tensor | None = None  # received activation (requires grad)
    output: torch.Tensor | None = None  # stage output, or the loss sum on the last stage
    output_grad: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None  # produced by the backward, lives until it is sent
    transfers: dict[str, Transfer] = field(default_factory=dict)


@dataclass
class IterationResult:
    """What one rank measured in one iteration: on the last stage, one report per micro-batch."""

    reports: list[dict[str, torch.Tensor]]
    num_tokens: int  # real tokens whose loss this rank computed (last stage only)
    loss_sum: float


class MissingPackedParams(ValueError):
    """The program's forward_step ran a THD micro-batch without its PackedSeqParams."""


class PlanExecutor:
    """Executes plans on one rank: stage `stage` of replica `replica` of a `num_replicas` x
    `num_stages` job, over `p2p` to the neighbouring stages. In a heterogeneous job `layouts`
    are the job's replica layouts (and `num_stages` this rank's pipeline's depth): a plan runs
    only if its layouts are exactly these."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: Any,
        *,
        stage: int,
        num_stages: int,
        replica: int,
        num_replicas: int,
        p2p: PeerToPeer,
        forward_step_func: ForwardStepFunc = gpt_forward_step,
        layouts: Sequence[ReplicaLayout] | None = None,
        slowdown: float = 1.0,
    ) -> None:
        self.model = model
        self.layouts = list(layouts) if layouts is not None else None
        self.config = config
        self.stage, self.num_stages = stage, num_stages
        self.replica, self.num_replicas = replica, num_replicas
        self.p2p = p2p
        self.forward_step_func = forward_step_func
        self.sequence_shards = sequence_shards(config)
        if layouts is not None and self.sequence_shards > 1:
            raise PlanRejected(
                "sequence parallelism is not supported between stages of different "
                "tensor-parallel degree"
            )
        self._set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
        # `--device-speed`: compute of this rank emulated this many times slower (device_speed).
        self.slowdown = slowdown
        self._thd_forward: int | None = None  # the THD micro-batch whose forward pass runs
        try:
            decoder = get_attr_wrapped_model(model, "decoder")
        except RuntimeError:  # not a megatron-core language model: nothing to check
            decoder = None
        if decoder is not None:
            decoder.register_forward_pre_hook(self._check_packed_params, with_kwargs=True)

    @classmethod
    def for_this_rank(
        cls,
        model: torch.nn.Module,
        config: Any,
        *,
        device: torch.device,
        timeout_s: float = 600.0,
        forward_step_func: ForwardStepFunc = gpt_forward_step,
        slowdown: float = 1.0,
    ) -> PlanExecutor:
        """The executor of this rank's (replica, stage), as `parallel_state` laid out the job;
        `slowdown`: this rank's `--device-speed` factor."""
        layouts = None
        p2p = PeerToPeer(ps.peer_rank, device, timeout_s)
        if ps.is_heterogeneous():
            layouts = ps.topology().layouts
            p2p = LeaderPeerToPeer(
                ps.peer_rank,
                device,
                timeout_s,
                tp_group=ps.pg_collection().tp,
                leader=ps.peer_rank(ps.stage()),
            )
        return cls(
            model,
            config,
            stage=ps.stage(),
            num_stages=ps.num_stages(),
            replica=ps.replica(),
            num_replicas=ps.num_replicas(),
            p2p=p2p,
            forward_step_func=forward_step_func,
            layouts=layouts,
            slowdown=slowdown,
        )

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def check(self, plan: ExecutionPlan) -> None:
        """Reject a plan for another job shape or one that breaks the plan contract, before any
        instruction runs (a wrong order would otherwise deadlock or corrupt gradients)."""
        if self.layouts is not None:
            self._check_layouts(plan)
        elif plan.replicas:
            raise PlanRejected(
                "plan is heterogeneous (it has replica layouts) but the job was laid out "
                "homogeneously; initialise it with parallel_state.initialize_heterogeneous"
            )
        elif (plan.num_stages, plan.num_replicas) != (self.num_stages, self.num_replicas):
            raise PlanRejected(
                f"plan is for {plan.num_replicas} replicas x {plan.num_stages} stages, the job "
                f"runs {self.num_replicas} x {self.num_stages}"
            )
        try:
            verify_plan(plan)
        except ValueError as err:
            raise PlanRejected(f"plan rejected before running: {err}") from err
        try:
            recompute = stage_mode(plan.stats, self.replica, self.stage)
        except (ValueError, IndexError, AttributeError) as err:
            raise PlanRejected(f"plan's recompute modes: {err}") from err
        if recompute is not None and recompute not in RECOMPUTE_MODES:
            raise PlanRejected(
                f"plan asks stage {self.stage} of replica {self.replica} for recompute="
                f"{recompute!r}; modes: {RECOMPUTE_MODES}"
            )
        wanted = self.config.pipeline_dtype
        for ins in plan.rank_plan(self.replica, self.stage).instructions:
            if ins.dtype and PLAN_DTYPES[ins.dtype] != wanted:
                raise PlanRejected(
                    f"plan transfers {ins.dtype} ({ins.op} mb {ins.mb}) but the model's "
                    f"pipeline dtype is {wanted}"
                )

    def _check_layouts(self, plan: ExecutionPlan) -> None:
        """A heterogeneous job runs only plans laid out exactly as its groups were built."""
        if not plan.replicas:
            raise PlanRejected(
                "plan is homogeneous (no replica layouts) but the job runs heterogeneous layouts"
            )
        if len(plan.replicas) != len(self.layouts):
            raise PlanRejected(
                f"plan has {len(plan.replicas)} replica(s), the job {len(self.layouts)}"
            )
        for k, (got, job) in enumerate(zip(plan.replicas, self.layouts, strict=True)):
            if got.num_stages != job.num_stages:
                raise PlanRejected(
                    f"replica {k}: plan has {got.num_stages} stage(s), the job {job.num_stages}"
                )
            for j, (a, b) in enumerate(zip(got.stages, job.stages, strict=True)):
                if (a.devices, a.tp, tuple(a.layers)) != (b.devices, b.tp, tuple(b.layers)):
                    raise PlanRejected(
                        f"replica {k} stage {j}: plan lays it out as {a.to_dict()}, the job "
                        f"as {b.to_dict()}"
                    )

    def run(
        self,
        plan: ExecutionPlan,
        batches: Mapping[int, Any],
        *,
        iteration: int = 0,
        forward_only: bool = False,
    ) -> IterationResult:
        """Run this rank's instructions of `plan`, then finalise gradients.

        `batches` maps this replica's micro-batch ids to what `forward_step_func` consumes.
        Gradients accumulate in the model (zero them before); the optimiser step is the
        caller's, as with megatron-core's schedules. The model recomputes activations as the
        plan says for this rank's stage (a plan that names no mode leaves the model's setting).

        `forward_only` (evaluation) runs the plan's forward passes and activation transfers
        without autograd and skips every backward pass and gradient transfer. Every rank drops
        the same instructions, so each pair of ranks still posts its remaining transfers in the
        same order, and the plan stays deadlock-free.
        """
        self.check(plan)
        instructions = plan.rank_plan(self.replica, self.stage).instructions
        if forward_only:
            instructions = [ins for ins in instructions if not _is_backward(ins)]
        else:
            recompute = stage_mode(plan.stats, self.replica, self.stage)
            if recompute is not None:
                apply_recompute(self.model, self.config, recompute)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            result = self._run(instructions, batches, iteration)
        if not forward_only:
            finalize = getattr(self.config, "finalize_model_grads_func", None)
            if finalize is not None:  # counts tokens once per pipeline, sums them over pipelines
                device = next(self.model.parameters()).device  # NCCL reduces device tensors
                finalize([self.model], num_tokens=torch.tensor(result.num_tokens, device=device))
        release_megatron_workspace()  # the plan priced it per iteration (memory.py)
        return result

    def _run(
        self,
        instructions: Sequence[Instruction],
        batches: Mapping[int, Any],
        iteration: int,
    ) -> IterationResult:
        """Every micro-batch's activations travel as THD, [1, rows x seqlen, hidden]."""
        states: dict[int, _MicroBatchState] = {}
        reports: list[dict[str, torch.Tensor]] = []
        tokens = torch.zeros((), dtype=torch.int64)
        loss_sum = 0.0
        backwards = [i for i, ins in enumerate(instructions) if ins.op == "BackwardPass"]
        last_backward = backwards[-1] if backwards else -1
        for index, ins in enumerate(instructions):
            state = states.setdefault(ins.mb, _MicroBatchState())
            # One range per instruction in a profiler's trace (`--profile`, nsys ranges).
            last = index == last_backward
            with torch.profiler.record_function(f"DynaPipe {ins.op} mb {ins.mb}"):
                result = self._execute(ins, state, batches, last, (iteration, index))
            if result is not None:
                reports.append(result[1])
                tokens += result[0]
                loss_sum += float(state.output.detach())
        return IterationResult(reports, int(tokens), loss_sum)

    def _execute(
        self,
        ins: Instruction,
        state: _MicroBatchState,
        batches: Mapping[int, Any],
        last_backward: bool,
        place: tuple[int, int],
    ) -> tuple[torch.Tensor, dict] | None:
        """Run one instruction (`place`: iteration and index, for transfer errors); a last
        stage's forward pass returns its micro-batch's (tokens, report)."""
        if ins.op == "ForwardPass":
            self._thd_forward = ins.mb
            try:
                return paced(self.slowdown, self._forward, ins, state, batches)
            finally:
                self._thd_forward = None
        if ins.op == "BackwardPass":
            with self._grad_sync(last_backward):
                paced(self.slowdown, self._backward, state)
        elif ins.op == "FreeBuffer":
            state.input = state.output = state.output_grad = None
        elif ins.op.endswith("Start"):
            iteration, index = place
            where = (  # errors of this transfer, up to its Wait, name it so
                f"iteration {iteration + 1}, replica {self.replica} stage {self.stage}, "
                f"instruction {index} ({ins.op} mb {ins.mb})"
            )
            shape = packed_shape(ins.shape, self.sequence_shards)
            state.transfers[ins.op] = self._start(ins, shape, state, where)
        elif ins.op.startswith("Wait"):
            self._wait(ins, state)
        return None

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[object]:
        """Megatron's gradient-sync rule (`config.no_sync_func`, as its schedules use it): DDP
        reduces gradients only in this stage's last backward pass, where with
        `--overlap-grad-reduce` the buckets start reducing while the pass still runs."""
        no_sync = getattr(self.config, "no_sync_func", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    # ---- instructions ----------------------------------------------------------------------

    def _forward(
        self, ins: Instruction, state: _MicroBatchState, batches: Mapping[int, Any]
    ) -> tuple[torch.Tensor, dict] | None:
        if not self.is_first:
            self._set_input_tensor(state.input)
        output, loss_func = self.forward_step_func(_read_when_asked(batches, ins.mb), self.model)
        if not self.is_last:
            state.output = output
            return None
        result = loss_func(output)
        if len(result) != 3:
            raise ValueError(
                "loss_func must return Megatron's per-token form (loss_sum, num_tokens, report)"
            )
        state.output, num_tokens, report = result
        return num_tokens.detach().cpu(), report

    def _check_packed_params(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A THD micro-batch must reach the decoder with its `PackedSeqParams`: without them
        its attention would silently span the samples (and rows) laid end to end."""
        if self._thd_forward is not None and kwargs.get("packed_seq_params") is None:
            raise MissingPackedParams(
                f"stage {self.stage}: forward_step ran micro-batch {self._thd_forward}, one THD "
                "sequence of several samples, without PackedSeqParams, so its attention would "
                "span them; build them from the batch's cu_seqlens and max_seqlen on every "
                "pipeline stage, as Megatron-LM's get_batch does"
            )

    def _backward(self, state: _MicroBatchState) -> None:
        output, grad = state.output, state.output_grad
        if self.is_last:  # the loss, scaled as megatron-core's schedules scale it (fp16)
            scale = getattr(self.config, "grad_scale_func", None)
            output, grad = (scale(output) if scale is not None else output), None
        torch.autograd.backward(output, grad_tensors=grad)
        if not self.is_first:
            state.input_grad = state.input.grad

    def _start(
        self, ins: Instruction, shape: Sequence[int], state: _MicroBatchState, where: str
    ) -> Transfer:
        if ins.op == "SendActStart":
            return self.p2p.start_send(state.output, ins.peer, shape, ins.dtype, where)
        if ins.op == "SendGradStart":
            grad, state.input_grad = state.input_grad, None
            return self.p2p.start_send(grad, ins.peer, shape, ins.dtype, where)
        return self.p2p.start_recv(ins.peer, shape, ins.dtype, where)

    def _wait(self, ins: Instruction, state: _MicroBatchState) -> None:
        start = ins.op.replace("Wait", "", 1) + "Start"
        tensor = self.p2p.wait(state.transfers.pop(start))
        if ins.op == "WaitRecvAct":
            state.input = tensor.requires_grad_(torch.is_grad_enabled())
        elif ins.op == "WaitRecvGrad":
            state.output_grad = tensor
