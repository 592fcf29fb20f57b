"""The planner prices the model Megatron's flags build: `model_flags.model_spec(args)` is the
preset of the same shape (so both cost the same in every cost model), and its parameter counts
equal those of the megatron-core modules the runtime builds from the same flags, for a GPT and
a Llama shape (grouped-query attention, SwiGLU, RMSNorm, RoPE, no biases, untied)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("megatron.training")

from distributed import run_ranks
from gpt_reference import LLAMA, SPEC

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.hetero.cost import TrainingJob
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search import analytic_cost_inputs
from megatron.dynapipe.arguments import parse_args
from megatron.dynapipe.model_flags import model_spec, spec_flags

LLAMA2_70B_FLAGS = [
    "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
    "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--train-iters", "1",
]  # fmt: skip


@pytest.mark.parametrize("preset", ["llama-7b", "llama2-13b", "llama2-70b", "gpt-1.3b"])
def test_megatron_flags_of_a_preset_give_the_preset(preset: str) -> None:
    expected = MODEL_PRESETS[preset]
    args = parse_args([*spec_flags(expected), "--seq-length", "2048", "--train-iters", "1"])
    spec = model_spec(args, expected.vocab_size, name=preset)
    assert spec == expected
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=4, num_replicas=1, tp=2)
    ours, theirs = (AnalyticCostModel(m, cluster).pipeline_costs("none") for m in (spec, expected))
    np.testing.assert_array_equal(ours.forward, theirs.forward)
    np.testing.assert_array_equal(ours.activation, theirs.activation)
    np.testing.assert_array_equal(ours.static, theirs.static)
    gpu = get_gpu("A100-80GB")
    assert analytic_cost_inputs(spec, gpu, 8) == analytic_cost_inputs(expected, gpu, 8)
    assert TrainingJob(spec).flops_per_sample() == TrainingJob(expected).flops_per_sample()


def test_llama2_70b_from_its_megatron_flags() -> None:
    spec = model_spec(parse_args(LLAMA2_70B_FLAGS), 32000, name="llama2-70b")
    assert spec == dataclasses.replace(MODEL_PRESETS["llama2-70b"], max_position_embeddings=4096)
    params = spec.num_layers * spec.layer_params("decoder") + spec.embedding_params()
    assert params + spec.vocab_size * spec.hidden_size + spec.hidden_size == 68_976_648_192


def _counted(rank: int, world: int, flags: tuple[str, ...]):
    """(layer 0, embedding, output layer) parameters of the megatron-core model the flags build,
    and the spec's counts of the same."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.model import build_stage_model
    from megatron.dynapipe.model_flags import spec_args

    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        args = spec_args(SPEC, 64, *flags)
        _, model = build_stage_model(args, SPEC.vocab_size)
        built = {"layer": 0, "embedding": 0, "output": 0}
        for name, param in model.named_parameters():
            if name.startswith("decoder.layers.0."):
                built["layer"] += param.numel()
            elif name.startswith("embedding."):
                built["embedding"] += param.numel()
            elif name.startswith("output_layer."):
                built["output"] += param.numel()
        spec = model_spec(args, SPEC.vocab_size)
        counted = {
            "layer": spec.layer_params("decoder"),
            "embedding": spec.embedding_params(),
            "output": spec.vocab_size * spec.hidden_size if "output" in built else 0,
        }
        return built, counted
    finally:
        ps.destroy()


@pytest.mark.parametrize("flags", [(), LLAMA], ids=["gpt", "llama"])
def test_parameter_counts_equal_the_built_modules(flags) -> None:
    built, counted = run_ranks(_counted, 1, flags)[0]
    if "--untie-embeddings-and-output-weights" not in flags:
        built["output"] = counted["output"] = 0  # tied: the embedding's weights
    assert built == counted
