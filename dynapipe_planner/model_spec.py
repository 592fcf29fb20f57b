"""Transformer shapes the cost models need: decoder-only (GPT) and encoder-decoder (T5).

A `ModelSpec` is pure shape; how long a layer takes or how much memory it holds is the cost
models' business (`dynapipe_planner.cost`). The shape is that of megatron-core's transformer
layer, including the Llama family's variants (grouped-query attention, gated MLP, RMSNorm, no
biases, rotary positions, untied output layer), so that a plan prices the model the runtime
builds from the same Megatron flags. Every count below follows from the weight shapes of
megatron-core's GPT layer, with h = hidden_size, n = num_heads, g = num_query_groups,
d = kv_channels and f = ffn_hidden_size:

    linear_qkv   h -> (n + 2 g) d    (Q for every head, one K and one V per group)
    linear_proj  n d -> h
    linear_fc1   h -> 2 f (gated: the gate and the up projection side by side) or h -> f
    linear_fc2   f -> h
    two norms    h each: weight and bias (LayerNorm) or weight only (RMSNorm)

Biases follow `add_bias_linear` (every linear layer) and `add_qkv_bias` (linear_qkv alone).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from .errors import PlanningError
from .input_files import load_json_file

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# Megatron's position embeddings of a GPT model; only learned absolute positions have weights.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "none")
_BOOL_FIELDS = (
    "gated_linear_unit",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
)


# A model dimension past this is a typo; the cost models multiply dimensions in int64.
MAX_MODEL_DIM = 2**31 - 1
_INT_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "ffn_hidden_size",
    "vocab_size",
    "kv_channels",
    "max_position_embeddings",
    "num_query_groups",
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT (`arch="gpt"`) or T5 (`arch="t5"`) model.

    For T5, `num_layers` counts the layers of the encoder and, separately, of the decoder
    (DynaPipe Table 1 convention), so a T5 pipeline holds `2 * num_layers` layers.

    The fields after `max_position_embeddings` carry megatron-core's names and default to a
    GPT-2/3 layer (multi-head attention, GeLU MLP, LayerNorm, biases, learned positions, output
    layer tied to the embedding). `num_query_groups` 0 means one K/V group per head; it is
    replaced by `num_heads` on construction, as `kv_channels` 0 is by `hidden_size / num_heads`.
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
    num_query_groups: int = 0
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    normalization: str = "LayerNorm"
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "t5"):
            raise PlanningError(
                f"model {self.name!r}: arch must be 'gpt' or 't5', got {self.arch!r}"
            )
        if not isinstance(self.name, str):
            raise PlanningError(f"model: name must be a string, got {self.name!r}")
        for f in _INT_FIELDS:  # JSON may bring floats (NaN), strings, booleans or huge numbers
            value = getattr(self, f)
            if type(value) is not int:
                raise PlanningError(f"model {self.name!r}: {f} must be an integer, got {value!r}")
            if value > MAX_MODEL_DIM:
                raise PlanningError(f"model {self.name!r}: {f} {value} is out of range")
        for f in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, f) <= 0:
                raise PlanningError(f"model {self.name!r}: {f} must be positive")
        for f in ("kv_channels", "max_position_embeddings", "num_query_groups"):
            if getattr(self, f) < 0:
                raise PlanningError(f"model {self.name!r}: {f} must not be negative")
        for f in _BOOL_FIELDS:
            if not isinstance(getattr(self, f), bool):
                raise PlanningError(
                    f"model {self.name!r}: {f} must be true or false, got {getattr(self, f)!r}"
                )
        if self.normalization not in NORMALIZATIONS:
            raise PlanningError(
                f"model {self.name!r}: normalization must be one of {NORMALIZATIONS}, "
                f"got {self.normalization!r}"
            )
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise PlanningError(
                f"model {self.name!r}: position_embedding_type must be one of "
                f"{POSITION_EMBEDDING_TYPES}, got {self.position_embedding_type!r}"
            )
        if self.kv_channels == 0:
            if self.hidden_size % self.num_heads:
                raise PlanningError(
                    f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                    f"num_heads {self.num_heads}; give kv_channels explicitly"
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_heads)
        if self.num_query_groups == 0:
            object.__setattr__(self, "num_query_groups", self.num_heads)
        if self.num_heads % self.num_query_groups:
            raise PlanningError(
                f"model {self.name!r}: num_heads {self.num_heads} is not divisible by "
                f"num_query_groups {self.num_query_groups}"
            )

    @property
    def is_encoder_decoder(self) -> bool:
        return self.arch == "t5"

    @property
    def attention_width(self) -> int:
        """Width of the concatenated attention heads (num_heads * kv_channels): Q's width."""
        return self.num_heads * self.kv_channels

    @property
    def kv_width(self) -> int:
        """Width of K, and of V (num_query_groups * kv_channels); below Q's with GQA."""
        return self.num_query_groups * self.kv_channels

    @property
    def fc1_width(self) -> int:
        """Output width of the MLP's first projection: 2 f when gated (gate and up), else f."""
        return (2 if self.gated_linear_unit else 1) * self.ffn_hidden_size

    def supports_tp(self, tp: int) -> bool:
        """Whether `tp` tensor-parallel ranks split the layer into equal whole parts: the heads,
        the K/V groups and the FFN width. (megatron-core also runs TP a multiple of the groups
        by gathering K/V across ranks, a traffic the cost models do not price.)"""
        return not (self.num_heads % tp or self.num_query_groups % tp or self.ffn_hidden_size % tp)

    def check_tp(self, tp: int) -> None:
        """Raise a `PlanningError` naming the model's part `tp` does not divide."""
        if self.supports_tp(tp):
            return
        groups = (
            f", its {self.num_query_groups} K/V groups"
            if self.num_query_groups != self.num_heads
            else ""
        )
        raise PlanningError(
            f"TP={tp} does not divide the {self.num_heads} heads of {self.name}{groups} or the "
            f"FFN width {self.ffn_hidden_size}"
        )

    def layer_kinds(self) -> list[str]:
        """Kinds of the transformer layers in pipeline order: 'encoder' and/or 'decoder'."""
        if self.is_encoder_decoder:
            return ["encoder"] * self.num_layers + ["decoder"] * self.num_layers
        return ["decoder"] * self.num_layers

    def attention_weights(self) -> int:
        """Weight entries of one attention block's GEMMs: linear_qkv h x (n + 2 g) d and
        linear_proj n d x h (biases and norms excluded). A token's forward pass through them
        costs twice this many FLOPs."""
        h = self.hidden_size
        return h * (self.attention_width + 2 * self.kv_width) + self.attention_width * h

    def mlp_weights(self) -> int:
        """Weight entries of the MLP's GEMMs: linear_fc1 h x (2 f or f), linear_fc2 f x h."""
        h = self.hidden_size
        return h * self.fc1_width + self.ffn_hidden_size * h

    def norm_params(self) -> int:
        """One norm over h: weight and bias (LayerNorm) or weight only (RMSNorm)."""
        return (1 if self.normalization == "RMSNorm" else 2) * self.hidden_size

    def layer_params(self, kind: str) -> int:
        """Parameters of one transformer layer: both GEMM blocks with their biases, and the norm
        before each. A T5 decoder layer adds a cross-attention block (Q and the output
        projection over its own tokens, K and V over the encoder's, the same shapes as
        self-attention) with its norm."""
        h, bias = self.hidden_size, self.add_bias_linear
        qkv_bias = self.attention_width + 2 * self.kv_width if bias or self.add_qkv_bias else 0
        attention = self.attention_weights() + qkv_bias + (h if bias else 0)
        mlp = self.mlp_weights() + (self.fc1_width + h if bias else 0)
        params = attention + mlp + 2 * self.norm_params()
        if kind == "decoder" and self.is_encoder_decoder:
            params += attention + self.norm_params()
        return params

    def embedding_params(self) -> int:
        """Word embeddings, plus position embeddings when they are learned (rotary positions
        have no weights)."""
        learned = self.position_embedding_type == "learned_absolute"
        return (
            self.vocab_size + (self.max_position_embeddings if learned else 0)
        ) * self.hidden_size

    def output_params(self) -> int:
        """The output layer's weight (vocabulary x h). Tied to the word embeddings it is one
        tensor where one stage holds both, and a copy on the last stage otherwise."""
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """Parameters of the whole model as megatron-core builds it: embedding, every layer,
        the final norm of each stack and, when untied, the output layer.

        The cost models price the stages' weights from `layer_params`, `embedding_params` and
        `output_params`; the final norm (h or 2 h parameters, under 1e-4 of the output layer)
        is left out of their stage memory.
        """
        stacks = 2 if self.is_encoder_decoder else 1
        params = sum(self.layer_params(k) for k in self.layer_kinds()) + self.embedding_params()
        params += stacks * self.norm_params()
        if self.untie_embeddings_and_output_weights:
            params += self.output_params()
        return params

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        if not isinstance(data, dict):
            raise PlanningError(f"model spec: expected a JSON object, got {type(data).__name__}")
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


def llama_spec(
    name: str, layers: int, hidden: int, heads: int, ffn: int, kv_groups: int = 0
) -> ModelSpec:
    """A LLaMA shape (Touvron et al. 2023): SwiGLU MLP of width `ffn`, RMSNorm, no biases,
    rotary positions, an output layer untied from the 32000-token embedding, and `kv_groups`
    K/V heads (grouped-query attention; 0: one per head)."""
    return ModelSpec(
        name,
        "gpt",
        layers,
        hidden,
        heads,
        ffn,
        32000,
        num_query_groups=kv_groups,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )


# GPT-3 family shapes (Brown et al. 2020, Table 2.1), DynaPipe's T5 scaling (Table 1) and the
# LLaMA-2 models Hydraulis trains (7B, 13B; its 32B-class shape is not published, so ours is
# LLaMA-1 30B's with 64 heads: 60 layers of width 6656, SwiGLU width 17920, 32.5B parameters).
# The LLaMA shapes are exact: `num_params()` gives the published counts (7B: 6,738,415,616).
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
        llama_spec("llama-7b", 32, 4096, 32, 11008),
        llama_spec("llama-13b", 40, 5120, 40, 13824),
        llama_spec("llama-32b", 60, 6656, 64, 17920),
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
        # Llama 30B is the LLaMA-1 shape (52 heads, so TP must divide 52); Llama-2 70B has 8 K/V
        # groups (grouped-query attention).
        llama_spec("llama2-7b", 32, 4096, 32, 11008),
        llama_spec("llama2-13b", 40, 5120, 40, 13824),
        llama_spec("llama-30b", 60, 6656, 52, 17920),
        llama_spec("llama2-70b", 80, 8192, 64, 28672, kv_groups=8),
    )
}


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name (see `MODEL_PRESETS`) or a JSON file with `ModelSpec` fields."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise PlanningError(
            f"model {name_or_path!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a file"
        )
    return ModelSpec.from_dict(load_json_file(path, "model spec"))
