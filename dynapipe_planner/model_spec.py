"""Transformer shapes the cost models need: decoder-only (GPT) and encoder-decoder (T5).

A `ModelSpec` is pure shape; how long a layer takes or how much memory it holds is the cost
models' business (`dynapipe_planner.cost`).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from .errors import PlanningError


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT (`arch="gpt"`) or T5 (`arch="t5"`) model.

    For T5, `num_layers` counts the layers of the encoder and, separately, of the decoder
    (DynaPipe Table 1 convention), so a T5 pipeline holds `2 * num_layers` layers.
    """

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    kv_channels: int = 0
    max_position_embeddings: int = 8192
    # Llama-style variations (Megatron's --group-query-attention --num-query-groups, --swiglu,
    # --disable-bias-linear, --normalization, --position-embedding-type); the defaults are GPT's.
    num_query_groups: int = 0  # K/V heads; 0: one per query head (multi-head attention)
    gated_linear_unit: bool = False  # SwiGLU: fc1 h -> 2f (gate and up), fc2 f -> h
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"  # or "RMSNorm" (a weight, no bias)
    position_embedding: str = "learned_absolute"  # or "rope" (no parameters)

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "t5"):
            raise PlanningError(
                f"model {self.name!r}: arch must be 'gpt' or 't5', got {self.arch!r}"
            )
        for f in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, f) <= 0:
                raise PlanningError(f"model {self.name!r}: {f} must be positive")
        if self.num_query_groups < 0 or (
            self.num_query_groups and self.num_heads % self.num_query_groups
        ):
            raise PlanningError(
                f"model {self.name!r}: num_query_groups {self.num_query_groups} must divide "
                f"num_heads {self.num_heads}"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise PlanningError(
                f"model {self.name!r}: normalization must be LayerNorm or RMSNorm, got "
                f"{self.normalization!r}"
            )
        if self.position_embedding not in ("learned_absolute", "rope"):
            raise PlanningError(
                f"model {self.name!r}: position_embedding must be learned_absolute or rope, "
                f"got {self.position_embedding!r}"
            )
        if self.kv_channels == 0:
            if self.hidden_size % self.num_heads:
                raise PlanningError(
                    f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                    f"num_heads {self.num_heads}; give kv_channels explicitly"
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_heads)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.arch == "t5"

    @property
    def attention_width(self) -> int:
        """Width of the concatenated attention heads (num_heads * kv_channels)."""
        return self.num_heads * self.kv_channels

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): one kv_channels-wide head per K/V group."""
        return (self.num_query_groups or self.num_heads) * self.kv_channels

    @property
    def attention_gemm_params(self) -> int:
        """Weights of one layer's attention projections: Q and the output (h x a each), K and V
        (h x kv_width each). With multi-head attention, 4 h a."""
        h = self.hidden_size
        return 2 * h * self.attention_width + 2 * h * self.kv_width

    @property
    def mlp_gemm_params(self) -> int:
        """Weights of one layer's MLP: fc1 (h x f, or h x 2f gated) and fc2 (f x h)."""
        return (3 if self.gated_linear_unit else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def mlp_width(self) -> float:
        """The width of a plain two-matrix MLP with this MLP's weights, FLOPs and activation
        traffic: f, or 1.5 f gated (fc1's 2f outputs and the f-wide gated product)."""
        return 1.5 * self.ffn_hidden_size if self.gated_linear_unit else self.ffn_hidden_size

    def tp_divides(self, tp: int) -> bool:
        """Whether tensor parallelism of degree `tp` splits the heads, the K/V groups and the
        MLP evenly (as megatron-core requires)."""
        groups = self.num_query_groups or self.num_heads
        return self.num_heads % tp == 0 and groups % tp == 0 and self.ffn_hidden_size % tp == 0

    def layer_kinds(self) -> list[str]:
        """Kinds of the transformer layers in pipeline order: 'encoder' and/or 'decoder'."""
        if self.is_encoder_decoder:
            return ["encoder"] * self.num_layers + ["decoder"] * self.num_layers
        return ["decoder"] * self.num_layers

    def layer_params(self, kind: str) -> int:
        """Parameters of one transformer layer (weights, biases unless disabled, both norms)."""
        h, a, f = self.hidden_size, self.attention_width, self.ffn_hidden_size
        bias = self.add_bias_linear
        attention = self.attention_gemm_params + bias * (a + 2 * self.kv_width + h)
        mlp = self.mlp_gemm_params + bias * ((2 * f if self.gated_linear_unit else f) + h)
        norm = (2 if self.normalization == "LayerNorm" else 1) * h
        params = attention + mlp + 2 * norm
        if kind == "decoder" and self.is_encoder_decoder:
            params += attention + norm  # cross-attention and its layer norm
        return params

    def embedding_params(self) -> int:
        """Word embeddings, plus learned position embeddings (RoPE has none)."""
        positions = self.max_position_embeddings if self.position_embedding != "rope" else 0
        return (self.vocab_size + positions) * self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanningError(f"model spec: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise PlanningError(f"model spec: missing field(s) {missing}")
        return cls(**data)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, "gpt", layers, hidden, heads, 4 * hidden, 51200)


def _llama(
    name: str, layers: int, hidden: int, heads: int, swiglu_width: int, kv_heads: int = 0
) -> ModelSpec:
    """A LLaMA shape as Megatron builds it: SwiGLU MLP, grouped-query attention with `kv_heads`
    K/V heads (0: one per head), RMSNorm, RoPE, no biases, vocabulary 32000."""
    return ModelSpec(
        name,
        "gpt",
        layers,
        hidden,
        heads,
        swiglu_width,
        32000,
        num_query_groups=kv_heads,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        position_embedding="rope",
    )


# GPT-3 family shapes (Brown et al. 2020, Table 2.1), DynaPipe's T5 scaling (Table 1) and the
# LLaMA-2 style models Hydraulis trains (7B, 13B; its 32B-class shape is not published, so
# ours has 60 layers of width 6656 with 64 heads, about 32B parameters).
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt("gpt-125m", 12, 768, 12),
        _gpt("gpt-350m", 24, 1024, 16),
        _gpt("gpt-1.3b", 24, 2048, 16),
        _gpt("gpt-2.7b", 32, 2560, 32),
        _gpt("gpt-3.35b", 16, 4096, 32),
        _gpt("gpt-6.7b", 32, 4096, 32),
        _gpt("gpt-13b", 40, 5120, 40),
        ModelSpec("t5-5.5b", "t5", 12, 1024, 128, 65536, 32128, kv_channels=128),
        ModelSpec("t5-11b", "t5", 24, 1024, 128, 65536, 32128, kv_channels=128),
        _llama("llama-7b", 32, 4096, 32, 11008),
        _llama("llama-13b", 40, 5120, 40, 13824),
        _llama("llama-32b", 60, 6656, 64, 17920),
        # Galvatron-BMW Table I shapes (seed galvatron_bmw.txt §VII-A). BERT and ViT are
        # encoder-only stacks with the same layer shape as a GPT layer (attention masks do not
        # change FLOPs or bytes here); ViT's "vocabulary" is its 1000-class head. T5-Large-32
        # has 16 encoder and 16 decoder layers.
        ModelSpec("bert-huge-32", "gpt", 32, 1280, 16, 5120, 30522, max_position_embeddings=512),
        ModelSpec("bert-huge-48", "gpt", 48, 1280, 16, 5120, 30522, max_position_embeddings=512),
        ModelSpec("vit-huge-32", "gpt", 32, 1280, 16, 5120, 1000, max_position_embeddings=197),
        ModelSpec("vit-huge-48", "gpt", 48, 1280, 16, 5120, 1000, max_position_embeddings=197),
        ModelSpec("t5-large-32", "t5", 16, 1024, 16, 4096, 32128, max_position_embeddings=512),
        ModelSpec("t5-large-48", "t5", 24, 1024, 16, 4096, 32128, max_position_embeddings=512),
        # BERT-xHuge and ViT-xHuge (Table I: 128 layers of width 2560, about 10B parameters);
        # Table I gives no head count, ours is 32 (head size 80).
        ModelSpec("bert-xhuge", "gpt", 128, 2560, 32, 10240, 30522, max_position_embeddings=512),
        ModelSpec("vit-xhuge", "gpt", 128, 2560, 32, 10240, 1000, max_position_embeddings=197),
        # HexiScale's models (seed hexiscale.txt §5.1, §5.4): Llama-2 7B/13B share the shapes above;
        # Llama 30B is the LLaMA-1 shape (52 heads, so TP must divide 52).
        _llama("llama2-7b", 32, 4096, 32, 11008),
        _llama("llama2-13b", 40, 5120, 40, 13824),
        _llama("llama-30b", 60, 6656, 52, 17920),
        _llama("llama2-70b", 80, 8192, 64, 28672, kv_heads=8),
    )
}


def megatron_shape_flags(model: ModelSpec) -> list[str]:
    """Megatron flags for the Llama-style variations of `model` (none for a GPT shape)."""
    flags = []
    if model.num_query_groups:
        flags.append(f"--group-query-attention --num-query-groups {model.num_query_groups}")
    if model.gated_linear_unit:
        flags.append("--swiglu")
    if not model.add_bias_linear:
        flags.append("--disable-bias-linear")
    if model.normalization != "LayerNorm":
        flags.append(f"--normalization {model.normalization}")
    if model.position_embedding != "learned_absolute":
        flags.append(f"--position-embedding-type {model.position_embedding}")
    return flags


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name (see `MODEL_PRESETS`) or a JSON file with `ModelSpec` fields."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise PlanningError(
            f"model {name_or_path!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanningError(f"model spec {path}: not valid JSON ({e})") from e
    return ModelSpec.from_dict(data)
