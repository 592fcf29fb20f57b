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

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "t5"):
            raise PlanningError(
                f"model {self.name!r}: arch must be 'gpt' or 't5', got {self.arch!r}"
            )
        for f in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, f) <= 0:
                raise PlanningError(f"model {self.name!r}: {f} must be positive")
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

    def layer_kinds(self) -> list[str]:
        """Kinds of the transformer layers in pipeline order: 'encoder' and/or 'decoder'."""
        if self.is_encoder_decoder:
            return ["encoder"] * self.num_layers + ["decoder"] * self.num_layers
        return ["decoder"] * self.num_layers

    def layer_params(self, kind: str) -> int:
        """Parameters of one transformer layer (weights and biases, both layer norms)."""
        h, a, f = self.hidden_size, self.attention_width, self.ffn_hidden_size
        attention = 4 * h * a + 3 * a + h
        mlp = 2 * h * f + f + h
        params = attention + mlp + 4 * h
        if kind == "decoder" and self.is_encoder_decoder:
            params += attention + 2 * h  # cross-attention and its layer norm
        return params

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.max_position_embeddings * self.hidden_size

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


def _llama(name: str, layers: int, hidden: int, heads: int, swiglu_width: int) -> ModelSpec:
    """LLaMA-2 style shape. Its SwiGLU MLP has three h x f matrices; a two-matrix MLP of width
    1.5 f has the same parameters and FLOPs, which is what the cost models count."""
    return ModelSpec(name, "gpt", layers, hidden, heads, 3 * swiglu_width // 2, 32000)


def _llama_gqa(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, swiglu_width: int
) -> ModelSpec:
    """LLaMA-2 70B style shape with grouped-query attention (`kv_heads` K/V heads).

    ModelSpec has no K/V-head count, so this is an approximation, stated: K and V projections
    of width `hidden * kv_heads / heads` save `2 * hidden^2 * (1 - kv_heads / heads)` parameters
    per layer against full multi-head attention, which ModelSpec counts; the MLP is narrowed by
    exactly that many parameters, so parameters and GEMM FLOPs per layer match the real model.
    Attention-score FLOPs and activations are those of full multi-head attention (a small
    overestimate of stored K/V activations)."""
    ffn = 3 * swiglu_width // 2
    saved = 2 * hidden * hidden * (heads - kv_heads) // heads
    return ModelSpec(name, "gpt", layers, hidden, heads, ffn - saved // (2 * hidden), 32000)


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
        _llama_gqa("llama2-70b", 80, 8192, 64, 8, 28672),
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
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanningError(f"model spec {path}: not valid JSON ({e})") from e
    return ModelSpec.from_dict(data)
