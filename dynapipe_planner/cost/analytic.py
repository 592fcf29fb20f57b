"""Analytic cost model: transformer FLOP and byte counts on a GPU spec, no profiling needed.

Time per layer = GEMMs + attention core (quadratic in sequence length) + memory-bound
element-wise work + tensor-parallel all-reduces + kernel launches. GEMMs and attention run at
an efficiency that saturates with the tokens of the micro-batch and the width of each TP shard,
so small micro-batches are slow per token, as on real GPUs; without that term every planner
would pick micro-batches of one sample. FLOP counts follow Narayanan et al. (SC'21) over the
layer's own GEMM shapes (grouped-query attention, gated MLP: `ModelSpec.attention_weights`,
`mlp_weights`); activation bytes follow Korthikanti et al. ("Reducing Activation
Recomputation", 2022) with the same widths, both public formulas. Used for paper-scale
studies on machines without a GPU (DynaPipe seed §3 "Cost models" uses profiling instead; see
`profiled.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..cluster import ClusterSpec, cluster_to_dict
from ..errors import PlanningError
from ..model_spec import ModelSpec
from .stages import assemble_pipeline
from .table import DTYPE_BYTES, PipelineCosts

RECOMPUTE_MODES = ("none", "selective", "full")
# What a planner accepts: one mode for every stage, or "auto" (the planner chooses).
RECOMPUTE_CHOICES = ("auto", *RECOMPUTE_MODES)


def geometric_grid(first_dense: int, step: int, ratio: float, stop: float) -> np.ndarray:
    """`step, 2*step, ..., first_dense` then points growing by `ratio` until `stop` is covered."""
    points = list(range(step, first_dense + 1, step))
    while points[-1] < stop:
        points.append(max(points[-1] + step, int(np.ceil(points[-1] * ratio / step) * step)))
    return np.array(points, dtype=np.float64)


@dataclass(frozen=True)
class Efficiency:
    """How close kernels get to the datasheet peak, and how fast that saturates."""

    gemm: float = 0.75
    tokens_half: float = 256.0
    width_half: float = 256.0
    seq_half: float = 128.0
    memory: float = 0.7
    kernels_per_layer_forward: int = 14


@dataclass(frozen=True)
class AnalyticCostModel:
    """Costs of `model` on `cluster` (its GPU type, TP degree and pipeline depth)."""

    model: ModelSpec
    cluster: ClusterSpec
    efficiency: Efficiency = Efficiency()
    flash_attention: bool = False
    distributed_optimizer: bool = False
    dtype: str = "bf16"
    # Megatron's --sequence-parallel: activations outside the TP regions are split over TP too.
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        self.model.check_tp(self.cluster.tp)

    def recompute_modes(self) -> list[str]:
        return list(RECOMPUTE_MODES)

    def describe(self) -> dict:
        """Enough to rebuild this model (`cost.cost_model_from_description`)."""
        return {
            "kind": "analytic",
            "model": self.model.to_dict(),
            "cluster": cluster_to_dict(self.cluster),
            "flash_attention": self.flash_attention,
            "distributed_optimizer": self.distributed_optimizer,
            "sequence_parallel": self.sequence_parallel,
            "dtype": self.dtype,
        }

    # ---- per-layer pieces, vectorised over micro-batch shapes ---------------------------
    def _gemm_time(self, flops, tokens):
        e, gpu = self.efficiency, self.cluster.gpu
        width = self.model.hidden_size / self.cluster.tp
        tokens = np.maximum(tokens, 1.0)  # no tokens, no FLOPs: 0 s rather than 0/0
        rate = gpu.peak_flops * e.gemm * tokens / (tokens + e.tokens_half)
        return flops / (rate * width / (width + e.width_half))

    def _attention_time(self, b, sq, sk):
        """Attention core (QK^T and AV) with its softmax traffic when not fused."""
        e, gpu, tp = self.efficiency, self.cluster.gpu, self.cluster.tp
        a, heads = self.model.attention_width, self.model.num_heads
        flops = 4.0 * b * sq * sk * a / tp
        sq_eff = np.maximum(sq, 1.0)  # an empty query (T5 target length 0) costs 0 s, not 0/0
        compute = flops / (gpu.peak_flops * e.gemm * sq_eff / (sq_eff + e.seq_half))
        if self.flash_attention:
            return compute
        score_bytes = 3 * 2.0 * b * heads / tp * sq * sk * 2  # write, softmax r/w, dropout
        return compute + score_bytes / (gpu.hbm_bandwidth * e.memory)

    def _elementwise_time(self, tokens):
        """Memory-bound passes over the layer's activations; the MLP's activation function reads
        and writes 2 f values a token (GeLU: f in, f out), a gated one 3 f (gate and up in, their
        product out), hence 4 f or 6 f of traffic over the forward's element-wise kernels."""
        m, tp = self.model, self.cluster.tp
        ffn = (6 if m.gated_linear_unit else 4) * m.ffn_hidden_size
        nbytes = 2.0 * tokens * (16 * m.hidden_size + ffn / tp)
        return nbytes / (self.cluster.gpu.hbm_bandwidth * self.efficiency.memory)

    def _allreduce_time(self, tokens, count):
        tp = self.cluster.tp
        if tp == 1:
            return 0.0 * tokens
        nbytes = tokens * self.model.hidden_size * DTYPE_BYTES[self.dtype]
        ring = 2.0 * (tp - 1) / tp * nbytes / self.cluster.tp_bandwidth
        return count * (ring + self.cluster.gpu.link_latency_s)

    def _stored_per_token(self) -> float:
        """Bytes one layer keeps per token for its backward pass, attention scores aside
        (Korthikanti et al. §4.1, 2-byte values): 10 h outside the tensor-parallel regions (the
        norms' inputs, the inputs of linear_qkv and linear_fc1, two dropout masks), split over
        TP with sequence parallelism; inside them, split over TP, Q, K, V and linear_proj's
        input, 8 h at the paper's width n d = h, with K and V at g / n of it under GQA; and the
        MLP's: for a gated MLP linear_fc1's 2 f outputs (the gated activation's input) and
        linear_fc2's f inputs, 6 f; for a GeLU MLP the paper's 16 h (GeLU's and linear_fc2's
        inputs at its f = 4 h). That is exact for every GPT preset; wider GeLU MLPs (the T5
        presets' f = 64 h) keep more than it says, left as it is so their plans keep their
        costs."""
        m, tp = self.model, self.cluster.tp
        h = m.hidden_size
        attention = 4 * h + 4 * h * m.num_query_groups / m.num_heads
        mlp = 6 * m.ffn_hidden_size if m.gated_linear_unit else 16 * h
        return (10 * h if not self.sequence_parallel else 10 * h / tp) + (attention + mlp) / tp

    def _layer(self, kind, b, s, t, recompute):
        """(forward s, backward s, stored bytes, transient bytes) of one layer. Its GEMMs run
        two FLOPs per weight entry and token (`ModelSpec.attention_weights`, `mlp_weights`)."""
        m = self.model
        h, a, heads, tp = m.hidden_size, m.attention_width, m.num_heads, self.cluster.tp
        launch = self.efficiency.kernels_per_layer_forward * self.cluster.gpu.kernel_launch_s
        cross = kind == "decoder" and m.is_encoder_decoder
        sq = t if (m.is_encoder_decoder and kind == "decoder") else s
        tokens = b * sq
        gemm_flops = 2.0 * tokens * (m.attention_weights() + m.mlp_weights()) / tp
        gemm = self._gemm_time(gemm_flops, tokens)
        attn = self._attention_time(b, sq, sq)
        elem = self._elementwise_time(tokens)
        comm = self._allreduce_time(tokens, 2)
        scores = 0.0 if self.flash_attention else 5.0 * heads * sq / tp
        act_core = sq * b * scores
        act_rest = sq * b * self._stored_per_token()
        if cross:
            src_tokens = b * s
            # Q/output projections run over the target tokens, K/V over the encoder output.
            gemm += self._gemm_time(2.0 * 2 * tokens * h * a / tp, tokens)
            gemm += self._gemm_time(2.0 * 2 * src_tokens * h * m.kv_width / tp, src_tokens)
            attn += self._attention_time(b, sq, s)
            elem += self._elementwise_time(tokens) * 0.5
            comm += self._allreduce_time(tokens, 1)
            act_rest += sq * b * (4 * h + 8 * h / tp) + 4.0 * s * b * m.kv_width / tp
            act_core += 0.0 if self.flash_attention else 5.0 * heads * sq * s * b / tp
            launch *= 1.5
        forward = gemm + attn + elem + comm + launch
        backward = 2 * gemm + 2 * attn + 2 * elem + comm + 2 * launch
        workspace = 4.0 * tokens * h + 2.0 * act_core / max(1.0, 5.0)
        if recompute == "none":
            stored, transient = act_rest + act_core, workspace
        elif recompute == "selective":
            stored, transient = act_rest, workspace + act_core
            backward = backward + attn
        else:
            stored, transient = 2.0 * tokens * h, workspace + act_rest + act_core
            backward = backward + forward
        return forward, backward, stored, transient

    def _embedding(self, b, s, t):
        h, gpu = self.model.hidden_size, self.cluster.gpu
        tokens = b * (s + t)
        io = 3.0 * tokens * h * 2 / (gpu.hbm_bandwidth * self.efficiency.memory)
        return io + gpu.kernel_launch_s, 2 * io + 2 * gpu.kernel_launch_s, 3.0 * tokens * h, 0.0 * b

    def _output_layer(self, b, s, t):
        m, tp, gpu = self.model, self.cluster.tp, self.cluster.gpu
        tokens = b * (t if m.is_encoder_decoder else s)
        vocab = m.vocab_size / tp
        gemm = self._gemm_time(2.0 * tokens * m.hidden_size * m.vocab_size / tp, tokens)
        softmax = tokens * vocab * (2 + 4 + 4) / (gpu.hbm_bandwidth * self.efficiency.memory)
        stored = 4.0 * tokens * m.hidden_size + 4.0 * tokens * vocab
        transient = tokens * vocab * (2 + 4 + 4)
        launch = 6 * gpu.kernel_launch_s
        return gemm + softmax + launch, 2 * gemm + softmax + 2 * launch, stored, transient

    def part_costs(
        self, part: str, samples: float, seqlen: float, recompute: str = "none"
    ) -> tuple[float, float, float, float]:
        """One micro-batch of `samples` x `seqlen` tokens through one transformer layer
        ("decoder"/"encoder"), the "embedding" or the "output" layer: forward s, backward s,
        stored and transient bytes. For planners that assemble their own stages from layers of
        different GPUs (HexiScale, `dynapipe_planner.hetero.cost`) instead of a pipeline table."""
        if recompute not in RECOMPUTE_MODES:
            raise PlanningError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        b, s, t = np.array([float(samples)]), np.array([float(seqlen)]), np.array([0.0])
        if part == "embedding":
            parts = self._embedding(b, s, t)
        elif part == "output":
            parts = self._output_layer(b, s, t)
        else:
            parts = self._layer(part, b, s, t, recompute)
        return tuple(float(np.asarray(x).reshape(-1)[0]) for x in parts)  # type: ignore[return-value]

    # ---- stages --------------------------------------------------------------------------
    def static_bytes(self, layer_kinds: list[str], first: bool, last: bool) -> float:
        """Weights (bf16), fp32 gradients and fp32 Adam state (master, m, v) of one stage. The
        last stage holds the output layer, which only a single stage with tied embeddings
        shares with the embedding (`ModelSpec.num_params` says what else is left out)."""
        m, tp = self.model, self.cluster.tp
        params = sum(m.layer_params(k) for k in layer_kinds)
        if first:
            params += m.embedding_params()
        own_output = m.untie_embeddings_and_output_weights or self.cluster.num_stages > 1
        if last and (own_output or not first):
            params += m.output_params()
        optimizer = 12.0 / (self.cluster.num_replicas if self.distributed_optimizer else 1)
        return params / tp * (2 + 4 + optimizer)

    def pipeline_costs(
        self,
        recompute: str = "none",
        *,
        max_samples: int = 1024,
        max_seqlen: int = 8192,
        max_tgt_seqlen: int = 0,
        layer_counts: Sequence[int] | None = None,
    ) -> PipelineCosts:
        """Tabulate every stage over a grid that covers the given micro-batch shapes;
        `layer_counts` splits the layers over the stages (default: as evenly as possible)."""
        if recompute not in RECOMPUTE_MODES:
            raise PlanningError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        m = self.model
        b_grid = geometric_grid(16, 1, 1.125, max(1, max_samples))
        s_grid = geometric_grid(128, 8, 1.0625, max(8, max_seqlen))
        t_grid = (  # T5: a column at target length 0 so short targets interpolate, not clamp
            np.concatenate([[0.0], geometric_grid(64, 8, 1.0625, max(8, max_tgt_seqlen))])
            if m.is_encoder_decoder
            else np.array([0.0])
        )
        b, s, t = np.meshgrid(b_grid, s_grid, t_grid, indexing="ij")
        kinds = {"decoder"} | ({"encoder"} if m.is_encoder_decoder else set())
        parts = {k: self._layer(k, b, s, t, recompute) for k in kinds}
        parts["embedding"] = self._embedding(b, s, t)
        parts["output"] = self._output_layer(b, s, t)
        c = self.cluster.num_stages
        return assemble_pipeline(
            m,
            self.cluster,
            (b_grid, s_grid, t_grid),
            parts,
            lambda kinds, j: self.static_bytes(kinds, j == 0, j == c - 1),
            lambda layout, _total: np.array([self._attention_coef(k, recompute) for k in layout]),
            recompute,
            self.dtype,
            layer_counts,
        )

    def _attention_coef(self, stage_kinds: list[str], recompute: str) -> float:
        """Forward+backward seconds per sample per token^2 of self-attention on one stage
        (long-sequence limit), used to price block-diagonal attention in packing."""
        one = np.array([1.0])
        big = np.array([1e6])
        per_layer = float((self._attention_time(one, big, big) / 1e12)[0])
        passes = 3 + (1 if recompute in ("selective", "full") else 0)
        return per_layer * passes * len(stage_kinds)
