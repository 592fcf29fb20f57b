"""DynaPipe for a training loop written on megatron-core alone (no megatron.training), such as
upstream Megatron-LM's `examples/run_simple_mcore_train_loop.py`.

Such a loop takes megatron-core's `get_forward_backward_func()` and calls it every iteration
with its `forward_step_func`, a data iterator and fixed micro-batch shapes. In its place it
takes `planned_forward_backward_func(model, train_dataset, *flags)`: the same call (the shape
arguments and the iterator are ignored) trains the next global batch of `train_dataset` as
DynaPipe plans it (seed `dynapipe.txt` §3, §6; the dataset as `data.program_samples` reads it,
in its own order), its micro-batches reaching `forward_step_func` as one THD sequence each
(`MicroBatchTensors.core_batch`: `tokens`, `labels`, `loss_mask`, `position_ids` of shape
[1, tokens], `attention_mask` None and the `packed_seq_params` to pass to the model). What the
loop changes (docs/megatron.md, "megatron-core-only loops"): its loss function returns Megatron's
per-token triple `(loss_sum, num_tokens, report)`, its model call passes
`packed_seq_params`, and it leaves gradient finalisation to the schedule, which divides by the
global batch's tokens (megatron-core's `finalize_model_grads`, set as the config's
`finalize_model_grads_func` unless the loop set one).

The model's shape and the parallel layout come from the model and megatron-core's groups;
`flags` are DynaPipe's (and Megatron's) command-line flags for the rest: `--train-iters`
(how far the planner works ahead) and the global batch (`--tokens-per-global-batch` or
`--global-batch-size`) at least.
"""

from __future__ import annotations

import atexit
import contextlib
import io
from typing import Any

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from dynapipe_planner.megatron_model import model_flags, spec_from_args
from dynapipe_planner.model_spec import ModelSpec

from . import arguments
from . import parallel_state as ps
from .data.datasets import DataSplits
from .data.program_samples import program_samples
from .iterations import PlannedIterations
from .job_config import JobConfig
from .megatron_loop import check_layer_split
from .packed_attention import use_packed_attention


class PlannedForwardBackward:
    """Called as megatron-core's `forward_backward_func`; see the module docstring."""

    def __init__(self, model: torch.nn.Module, iterations: PlannedIterations) -> None:
        self.model = model
        self.iterations = iterations
        self.iteration = 0
        self._bound = False

    def __call__(
        self,
        *,
        forward_step_func: Any,
        model: torch.nn.Module | list[torch.nn.Module],
        forward_only: bool = False,
        **ignored: Any,  # the iterator and micro-batch shapes megatron-core's schedules take
    ) -> list[dict[str, torch.Tensor]]:
        """Train the next planned global batch; the last stage's loss reports, as
        megatron-core's schedules return them."""
        if forward_only:
            raise ValueError("DynaPipe's core-loop schedule trains; evaluate with megatron-core's")
        if not self._bound:
            config = get_model_config(self.model)
            self.iterations.bind(self.model, config, ps.device(), forward_step_func, True)
            self._bound = True
        work = self.iterations.next(self.iteration)
        self.iteration += 1
        return work.run().reports


def planned_forward_backward_func(
    model: torch.nn.Module, train_dataset: Any, *flags: str
) -> PlannedForwardBackward:
    """DynaPipe's schedule for `model` (this rank's model chunk, DDP-wrapped or not) over
    `train_dataset` (None on ranks that read no data), planned with `flags`; a collective:
    every rank calls it once, after megatron-core's groups exist."""
    config = get_model_config(model)
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    dp = mpu.get_data_parallel_world_size()
    if dp > 1 and not config.calculate_per_token_loss:
        raise ValueError(
            "DynaPipe's loss is per token over the global batch: build the model (and its "
            "DDP) from a TransformerConfig with calculate_per_token_loss=True"
        )
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron lists every argument it parsed
        args = arguments.parse_args([*job_flags(model), "--dynamic-micro-batching", *flags])
    ps.adopt_megatron_groups()
    use_packed_attention(model)
    check_layer_split(model, args)
    reads = mpu.get_tensor_model_parallel_rank() == 0
    samples = program_samples(train_dataset, args, ps.device(), reads)
    spec = spec_from_args(args, get_attr_wrapped_model(model, "vocab_size"), name="core_loop")
    splits = DataSplits(samples, None, None)
    iterations = PlannedIterations(args, JobConfig.of(args), splits, spec, shuffle=False)
    iterations.__enter__()
    atexit.register(iterations.__exit__, None, None, None)
    return PlannedForwardBackward(model, iterations)


def job_flags(model: torch.nn.Module) -> list[str]:
    """Megatron's flags for megatron-core GPT `model` as this rank holds it: its shape
    (`model_spec`, through the planner's `model_flags`), sequence length, dropout, precision
    and parallel layout."""
    config = get_model_config(model)
    gpt = get_attr_wrapped_model(model, "vocab_size", return_model_obj=True)
    flags = [
        *model_flags(model_spec(model)),
        "--seq-length", str(gpt.max_sequence_length),
        "--hidden-dropout", str(config.hidden_dropout),
        "--attention-dropout", str(config.attention_dropout),
        "--tensor-model-parallel-size", str(mpu.get_tensor_model_parallel_world_size()),
        "--pipeline-model-parallel-size", str(mpu.get_pipeline_model_parallel_world_size()),
    ]  # fmt: skip
    if config.bf16:
        flags.append("--bf16")
    elif config.fp16:
        flags.append("--fp16")
    return flags


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """The shape of megatron-core GPT `model` (its `TransformerConfig` and `GPTModel`)."""
    config = get_model_config(model)
    gpt = get_attr_wrapped_model(model, "vocab_size", return_model_obj=True)
    groups = config.num_query_groups or config.num_attention_heads
    return ModelSpec(
        "core_loop",
        "gpt",
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.ffn_hidden_size,
        gpt.vocab_size,
        kv_channels=config.kv_channels,
        max_position_embeddings=gpt.max_sequence_length,
        num_query_groups=groups if groups != config.num_attention_heads else 0,
        gated_linear_unit=config.gated_linear_unit,
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        normalization=config.normalization,
        untie_embeddings_and_output_weights=not gpt.share_embeddings_and_output_weights,
        position_embedding_type=gpt.position_embedding_type,
    )
