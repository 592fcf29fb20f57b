"""The planner's ModelSpec and the model that runs: Megatron's parser turns `model_flags(spec)`
back into `spec` (`spec_from_args`), and the GPT megatron-core builds from those flags holds
exactly the parameters `ModelSpec` counts, tensor by tensor (issue 16: a preset and a runtime
config of the same shape give the same cost)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks
from layer_shapes import count, layer_tensors

from dynapipe_planner.errors import PlanningError
from dynapipe_planner.megatron_model import model_flags, spec_from_args
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec, llama_spec

TINY = [
    ModelSpec("tiny-gpt", "gpt", 2, 64, 4, 256, 128, max_position_embeddings=32),
    dataclasses.replace(llama_spec("tiny-llama", 2, 64, 8, 96, kv_groups=2), vocab_size=128),
    dataclasses.replace(
        llama_spec("tiny-qkv-bias", 2, 64, 4, 80),
        vocab_size=128,
        add_qkv_bias=True,
        normalization="LayerNorm",
        position_embedding_type="learned_absolute",
        max_position_embeddings=32,
    ),
]


def _args(spec: ModelSpec, *extra: str):
    from megatron.dynapipe.arguments import parse_args

    seq = min(32, spec.max_position_embeddings)
    return parse_args([*model_flags(spec), "--seq-length", str(seq), "--train-iters", "1", *extra])


@pytest.mark.parametrize(
    "spec",
    [MODEL_PRESETS["gpt-1.3b"], MODEL_PRESETS["llama-7b"], MODEL_PRESETS["llama2-70b"], *TINY],
    ids=lambda s: s.name,
)
def test_megatron_parses_the_flags_back_into_the_spec(spec: ModelSpec) -> None:
    assert spec_from_args(_args(spec), spec.vocab_size, spec.name) == spec


def test_a_layer_the_planner_cannot_price_is_refused_by_flag() -> None:
    args = _args(TINY[1], "--qk-layernorm")
    with pytest.raises(PlanningError, match="--qk-layernorm"):
        spec_from_args(args, 128)


def _built_shapes() -> list[dict[str, tuple[int, ...]]]:
    """Every parameter's shape in the whole (one-stage) GPT megatron-core builds for each spec."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.model import build_gpt_model

    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        out = []
        for spec in TINY:
            _, model = build_gpt_model(
                _args(spec), spec.vocab_size, pre_process=True, post_process=True
            )
            out.append({n: tuple(p.shape) for n, p in model.named_parameters()})
        return out
    finally:
        ps.destroy()


@pytest.fixture(scope="module")
def built() -> list[dict[str, tuple[int, ...]]]:
    return run_ranks(lambda rank, world: _built_shapes(), 1, timeout_s=180)[0]


@pytest.mark.parametrize("index", range(len(TINY)), ids=[s.name for s in TINY])
def test_built_model_holds_the_parameters_modelspec_counts(built, index: int) -> None:
    spec, shapes = TINY[index], built[index]

    def numel(prefix: str) -> int:
        return count((n, s) for n, s in shapes.items() if n.startswith(prefix))

    for layer in range(spec.num_layers):
        prefix = f"decoder.layers.{layer}."
        mine = {n.removeprefix(prefix): s for n, s in shapes.items() if n.startswith(prefix)}
        assert mine == dict(layer_tensors(spec))
        assert numel(prefix) == spec.layer_params("decoder")
    assert numel("embedding.") == spec.embedding_params()
    assert numel("decoder.final_layernorm.") == spec.norm_params()
    untied = spec.untie_embeddings_and_output_weights
    assert numel("output_layer.") == (spec.output_params() if untied else 0)
    assert numel("") == spec.num_params()
