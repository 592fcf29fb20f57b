"""ModelSpec's Llama fields: parameter and FLOP counts against a direct count over the weight
shapes, the published LLaMA sizes, activation bytes against an inventory of saved tensors,
validation, JSON round trips, and a preset pricing exactly as a hand-built spec of its shape in
every cost model."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from layer_shapes import count, layer_tensors

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost.analytic import AnalyticCostModel
from dynapipe_planner.devices import load_cluster
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.hetero.cost import HeteroCostModel, TrainingJob
from dynapipe_planner.hetero.layout import HeteroPipeline, HeteroPlan, HeteroStage
from dynapipe_planner.megatron_model import model_flags
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec, load_model_spec
from dynapipe_planner.search import search
from dynapipe_planner.search.cost_inputs import analytic_cost_inputs
from dynapipe_planner.strategy.schemes import (
    analytic_scheme_models,
    profile_scheme,
    scheme_space,
    scheme_tables,
)

A100 = get_gpu("A100-80GB")


def gemm_entries(m: ModelSpec) -> int:
    """Entries of the weight matrices a token passes through in one self-attention layer."""
    tensors = layer_tensors(m, "encoder")
    return count((n, s) for n, s in tensors if n.endswith(".weight") and len(s) == 2)


VARIANTS = [
    MODEL_PRESETS["gpt-1.3b"],
    MODEL_PRESETS["t5-large-32"],
    MODEL_PRESETS["t5-11b"],
    MODEL_PRESETS["llama-7b"],
    MODEL_PRESETS["llama2-70b"],
    ModelSpec(
        "qkv-bias", "gpt", 3, 96, 12, 160, 300, num_query_groups=4, gated_linear_unit=True,
        add_bias_linear=False, add_qkv_bias=True, max_position_embeddings=40,
    ),
    ModelSpec(
        "t5-gqa", "t5", 2, 64, 8, 96, 128, kv_channels=16, num_query_groups=2,
        gated_linear_unit=True, normalization="RMSNorm", untie_embeddings_and_output_weights=True,
    ),
]  # fmt: skip


@pytest.mark.parametrize("m", VARIANTS, ids=lambda m: m.name)
def test_layer_params_equal_a_count_over_the_weight_shapes(m: ModelSpec) -> None:
    for kind in set(m.layer_kinds()):
        assert m.layer_params(kind) == count(layer_tensors(m, kind))
    assert m.attention_weights() + m.mlp_weights() == gemm_entries(m)
    learned = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else 0
    assert m.embedding_params() == (m.vocab_size + learned) * m.hidden_size
    final_norms = (2 if m.is_encoder_decoder else 1) * count(
        [s for s in layer_tensors(m) if s[0].startswith("input_layernorm.")]
    )
    untied = m.vocab_size * m.hidden_size if m.untie_embeddings_and_output_weights else 0
    layers = sum(count(layer_tensors(m, k)) for k in m.layer_kinds())
    assert m.num_params() == layers + m.embedding_params() + final_norms + untied


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        ("llama-7b", 6_738_415_616),  # LLaMA-2-7B
        ("llama2-7b", 6_738_415_616),
        ("llama-13b", 13_015_864_320),  # LLaMA-2-13B
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),  # LLaMA-2-70B, 8 K/V groups
        ("llama-30b", 32_528_943_616),  # LLaMA-1 30B ("33B")
    ],
)
def test_llama_presets_have_the_published_parameter_counts(preset: str, published: int) -> None:
    assert MODEL_PRESETS[preset].num_params() == published


def test_default_fields_are_todays_gpt_layer() -> None:
    """GPT-3 1.3B by the pre-Llama formula (4 h a + 3 a + h attention, 2 h f + f + h MLP, two
    LayerNorms; learned positions): the defaults describe that layer."""
    m = MODEL_PRESETS["gpt-1.3b"]
    h, a, f = m.hidden_size, m.attention_width, m.ffn_hidden_size
    assert m.num_query_groups == m.num_heads
    assert m.layer_params("decoder") == 4 * h * a + 3 * a + h + 2 * h * f + f + h + 4 * h
    assert m.embedding_params() == (51200 + 8192) * h


def _analytic(m: ModelSpec, tp: int = 1, **kw) -> AnalyticCostModel:
    return AnalyticCostModel(m, ClusterSpec(A100, num_stages=2, tp=tp), **kw)


class _RecordingModel(AnalyticCostModel):
    """The analytic model, remembering the FLOPs it prices its GEMMs at."""

    def _gemm_time(self, flops, tokens):
        self.__dict__.setdefault("flops", []).append(float(np.asarray(flops).reshape(-1)[0]))
        return super()._gemm_time(flops, tokens)


@pytest.mark.parametrize("name", ["gpt-1.3b", "llama-7b", "llama2-70b"])
@pytest.mark.parametrize("tp", [1, 8])
def test_gemm_flops_are_two_per_weight_entry_and_token(name: str, tp: int) -> None:
    m = MODEL_PRESETS[name]
    model = _RecordingModel(m, ClusterSpec(A100, tp=tp))
    model.part_costs("decoder", 3, 512)
    assert model.flops == [2.0 * 3 * 512 * gemm_entries(m) / tp]
    job = TrainingJob(m, seqlen=512)
    core = 2 * 2 * 512 * m.num_heads * m.kv_channels  # Q K^T and scores x V per token
    assert job.layer_flops_per_token() == 2 * gemm_entries(m) + core


def stored_tensor_bytes(m: ModelSpec) -> int:
    """Bytes per token one layer saves for backward (2-byte values, no TP, scores aside), listed
    tensor by tensor as Korthikanti et al. do with the attention width at h: both norms'
    inputs, linear_qkv's input, Q, K, V, linear_proj's input, two dropout masks (1 byte),
    linear_fc1's input; then a GeLU MLP of width 4 h saves GeLU's input and linear_fc2's, a
    gated one its 2 f gate and up values and linear_fc2's f inputs."""
    h, kv = m.hidden_size, m.hidden_size * m.num_query_groups // m.num_heads
    attention = 2 * h + 2 * h + 2 * h + 2 * h + 2 * kv + 2 * kv + 2 * h + h + h + 2 * h
    mlp = 2 * (2 * m.ffn_hidden_size) + 2 * m.ffn_hidden_size if m.gated_linear_unit else 16 * h
    return attention + mlp


@pytest.mark.parametrize("name", ["gpt-1.3b", "llama-7b", "llama2-70b"])
def test_stored_activations_equal_the_saved_tensors(name: str) -> None:
    m = MODEL_PRESETS[name]
    _, _, stored, _ = _analytic(m, flash_attention=True).part_costs("decoder", 2, 1000)
    assert stored == 2 * 1000 * stored_tensor_bytes(m)


def test_swiglu_stores_more_and_gqa_less() -> None:
    gated = MODEL_PRESETS["llama-7b"]
    gelu = dataclasses.replace(gated, gated_linear_unit=False, ffn_hidden_size=4 * 4096)
    gqa = dataclasses.replace(gated, num_query_groups=8)

    def stored(m: ModelSpec) -> float:
        return _analytic(m, flash_attention=True).part_costs("decoder", 1, 4096)[2]

    assert stored(gated) - stored(gelu) == 4096 * (6 * 11008 - 16 * 4096)
    assert stored(gated) - stored(gqa) == 4096 * 4 * (4096 - 4096 * 8 // 32)


def test_untied_output_layer_is_its_own_weight_on_one_stage() -> None:
    llama = MODEL_PRESETS["llama-7b"]
    tied = dataclasses.replace(llama, untie_embeddings_and_output_weights=False)
    one = ClusterSpec(A100, num_stages=1)
    extra = 2 + 4 + 12  # bytes per parameter: bf16 weight, fp32 gradient, Adam
    kinds = ["decoder"] * 32
    diff = AnalyticCostModel(llama, one).static_bytes(kinds, True, True) - AnalyticCostModel(
        tied, one
    ).static_bytes(kinds, True, True)
    assert diff == 32000 * 4096 * extra
    two = ClusterSpec(A100, num_stages=2)  # a copy on the last stage either way
    assert AnalyticCostModel(llama, two).static_bytes(kinds, False, True) == AnalyticCostModel(
        tied, two
    ).static_bytes(kinds, False, True)


def test_tp_must_divide_the_kv_groups() -> None:
    m = MODEL_PRESETS["llama2-70b"]
    assert m.supports_tp(8) and not m.supports_tp(16)
    with pytest.raises(
        PlanningError, match="TP=16 does not divide the 64 heads of llama2-70b, its 8 K/V groups"
    ):
        _analytic(m, tp=16)
    assert max(s.tp for s in scheme_space(m, 64, max_tp=16)) == 8
    assert 16 not in analytic_cost_inputs(m, A100, 16).layer_types[0].forward_s_per_sample


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_query_groups": 5}, "num_query_groups"),
        ({"num_query_groups": -1}, "num_query_groups"),
        ({"normalization": "rmsnorm"}, "normalization"),
        ({"position_embedding_type": "relative"}, "position_embedding_type"),
        ({"gated_linear_unit": "yes"}, "gated_linear_unit"),
        ({"add_bias_linear": 0}, "add_bias_linear"),
        ({"untie_embeddings_and_output_weights": None}, "untie_embeddings_and_output_weights"),
    ],
)
def test_invalid_fields_are_named(change: dict, field: str) -> None:
    data = {**MODEL_PRESETS["llama-7b"].to_dict(), **change}
    with pytest.raises(PlanningError, match=f"model 'llama-7b': .*{field}"):
        ModelSpec.from_dict(data)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_to_dict_round_trips(name: str) -> None:
    m = MODEL_PRESETS[name]
    assert ModelSpec.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_json_without_the_new_fields_is_a_gpt(tmp_path) -> None:
    path = tmp_path / "old.json"
    old = {"name": "gpt-1.3b", "arch": "gpt", "num_layers": 24, "hidden_size": 2048,
           "num_heads": 16, "ffn_hidden_size": 8192, "vocab_size": 51200}  # fmt: skip
    path.write_text(json.dumps(old))
    assert load_model_spec(str(path)) == MODEL_PRESETS["gpt-1.3b"]


def test_model_flags_name_the_llama_architecture() -> None:
    assert model_flags(MODEL_PRESETS["llama2-70b"]) == [
        "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
        "--ffn-hidden-size", "28672", "--kv-channels", "128", "--max-position-embeddings", "8192",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ]  # fmt: skip
    assert model_flags(MODEL_PRESETS["gpt-1.3b"]) == [
        "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--ffn-hidden-size", "8192", "--kv-channels", "128", "--max-position-embeddings", "8192",
    ]  # fmt: skip


# ---- a preset and a hand-built spec of its shape price identically ---------------------------


def hand_built(name: str) -> ModelSpec:
    """The shape of preset `name` written out field by field, under another name."""
    shapes = {
        "llama-7b": (32, 4096, 32, 11008, 0),
        "llama2-70b": (80, 8192, 64, 28672, 8),
    }
    layers, hidden, heads, ffn, groups = shapes[name]
    return ModelSpec(
        name="runtime",
        arch="gpt",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=32000,
        kv_channels=128,
        max_position_embeddings=8192,
        num_query_groups=groups,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )


def _same(a, b) -> None:
    """Equal bit for bit: arrays, numbers, and containers of them."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("name", ["llama-7b", "llama2-70b"])
def test_preset_and_hand_built_spec_price_the_same(name: str) -> None:
    preset, built = MODEL_PRESETS[name], hand_built(name)
    assert dataclasses.replace(built, name=name) == preset
    # Analytic pipeline tables (DynaPipe's planner core).
    for tp in (1, 8):
        a, b = (
            _analytic(m, tp, sequence_parallel=True).pipeline_costs(
                "selective", max_samples=4, max_seqlen=2048
            )
            for m in (preset, built)
        )
        _same(dataclasses.asdict(a), dataclasses.asdict(b))
    # Galvatron-BMW: cost inputs and the searched plan.
    ci_a, ci_b = (analytic_cost_inputs(m, A100, 8, seq_length=2048) for m in (preset, built))
    dict_a, dict_b = ci_a.to_dict(), ci_b.to_dict()
    assert dict_a.pop("description")["model"] == name
    dict_b.pop("description")
    _same(dict_a, dict_b)
    found = [search(m, ci, 8, 200 * 2**30, global_batch_size=16) for m, ci in
             ((preset, ci_a), (built, ci_b))]  # fmt: skip
    assert found[0].throughput == found[1].throughput
    assert found[0].partition == found[1].partition
    # Hydraulis: scheme profiles.
    for m in (preset, built):
        models = analytic_scheme_models(m, A100, 16)
        profiles = [profile_scheme(s, scheme_tables(models, 8192)(s)) for s in scheme_space(m, 16)]
        if m is preset:
            first = profiles
    _same(
        [(p.max_len, p.util_len, p.coef, p.stage_times) for p in first],
        [(p.max_len, p.util_len, p.coef, p.stage_times) for p in profiles],
    )
    # HexiScale: one plan on the mixed 8-GPU box, estimated.
    cluster = load_cluster("examples/clusters/mixed_8gpu.yaml")
    half = preset.num_layers // 2
    stages = (HeteroStage((0, 1, 2, 3), (0, half)), HeteroStage((4, 5, 6, 7), (half, 2 * half)))
    plan = HeteroPlan([HeteroPipeline(stages, 16)], micro_batch_size=1, seqlen=2048)
    estimates = [
        HeteroCostModel(cluster, TrainingJob(m, seqlen=2048, global_batch=16)).estimate(plan)
        for m in (preset, built)
    ]
    _same(estimates[0].as_stats(), estimates[1].as_stats())
    assert TrainingJob(preset).flops_per_sample() == TrainingJob(built).flops_per_sample()
