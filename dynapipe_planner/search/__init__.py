"""Galvatron-BMW: automatic DP / SDP / TP / PP / CKPT search (seed `galvatron_bmw.txt`).

Public API (stable)::

    search(model: ModelSpec, cost_inputs: CostInputs, num_gpus: int, memory_budget: float, *,
           global_batch_size: int | None = None, batch_sizes: Sequence[int] | None = None,
           max_batch_size: int = 8192, pp_degrees: Sequence[int] | None = None,
           max_tp: int | None = None,
           strategy_filter: Callable[[LayerStrategy], bool] | None = None,
           bi_objective: bool = True, prune: bool = True, memory_bins: int = 256,
           microbatch_counts: int | None = None, batch_window: int = 2,
           max_adjust_steps: int | None = None, stop_after_misses: int = 2,
           num_microbatches: int | None = None, even_partition: bool = False,
           progress: Callable[[int, int], None] | None = None) -> SearchResult

    `memory_budget` is bytes per GPU; `bi_objective=False` is Galvatron-Base (memory-balanced
    partition only); `even_partition=True` splits layers evenly over stages and skips the
    partition search (the space of engines without one). Raises PlanningError naming the
    smallest budget that fits. Every micro-batch count dividing the global batch is tried
    (`microbatch_counts=k`: only the first k of P, 2P, 4P, ...).

    price_plan(cost_inputs, strategies: Sequence[LayerStrategy], partition: Sequence[int],
               num_microbatches: int, global_batch_size: int) -> PlanPrice
        PlanPrice: throughput, iteration_time_s, stage_time_s, stage_memory_bytes,
                   fits(memory_budget). The search's own estimator on a given plan (a
                   search result reprices to its throughput; another engine's plan can be
                   compared on equal terms).

    balance_partitions(cost_inputs, strategies, global_batch_size, num_microbatches)
        -> (p_m, p_t): the memory-balanced partition the bi-objective search starts from and
        the time-balanced one it moves towards (§IV-B, Fig. 4), without a memory budget.

    analytic_cost_inputs(model, gpu: GpuSpec, num_gpus, *, gpus_per_node=8, seq_length=1024,
                         tgt_seq_length=None, overlap_slowdown=1.3, flash_attention=False,
                         reference_tokens=8192) -> CostInputs

    CostInputs (frozen dataclass; build it directly or with analytic_cost_inputs):
        layer_types: tuple[LayerTypeCosts, ...]
        layer_kinds: tuple[int, ...]             # layer type index of every layer, in order
        allreduce_bandwidth: dict[(size, stride), bytes/s]   # bus bandwidth of a group of
                                                 # `size` GPUs `stride` ids apart (1: consecutive)
        p2p_bandwidth: dict[pp_degree, bytes/s]  # between neighbouring stages
        overlap_slowdown: float = 1.3            # compute/communication overlap slowdown
        model_state_factor: float = 9.0          # model-state bytes per weight byte (bf16 + Adam)
        link_latency_s: float = 10e-6
        embedding_param_bytes, output_param_bytes: float      # first / last stage
        output_forward_s_per_sample, output_activation_bytes_per_sample: float
        seq_length: int
        description: dict
        to_dict() / CostInputs.from_dict(d)      # JSON round trip ("size,stride" keys)

    LayerTypeCosts (frozen dataclass), per layer type at the job's sequence length:
        name: str
        forward_s_per_sample: dict[tp, s]        # forward compute per sample, TP shard, no comm
        activation_bytes_per_sample: dict[tp, bytes]   # kept for backward without CKPT
        workspace_bytes_per_sample: dict[tp, bytes]    # transient bytes of its backward
        param_bytes: float                       # bf16 weight bytes, unsharded
        boundary_bytes_per_sample: float         # layer input (kept under CKPT, p2p size)
        tp_allreduce_bytes_per_sample: float     # all-reduced by TP per sample, one forward
        backward_s_per_sample: dict[tp, s] = {}  # measured backward; absent: twice the forward

    profiled_cost_inputs(model, read_cost_tables(paths), num_gpus, *, seq_length, max_tp=None,
                         overlap_slowdown=1.3) -> CostInputs
        From tools/profile_costs.py tables (one per TP degree): per-sample entries at the job's
        sequence length, measured bandwidths (profiled_inputs.py says how they are scaled).

    SearchResult: throughput (samples/s), iteration_time_s, global_batch_size,
        num_microbatches, pp, partition (layers per stage), strategies (LayerStrategy per
        layer: pp, tp, dp, sdp, order root->leaf, ckpt), stage_memory_bytes, stage_time_s,
        memory_budget_bytes, bi_objective, base_throughput, evaluated, search_time_s.

    strategy_space(num_gpus, prune=True) -> {pp: [LayerStrategy]}   (68 / 44 for 8 GPUs)
    write_plan(result, path, model) / megatron_flags(result, model)  (plan_file.py)
"""

from .cost_inputs import CostInputs, LayerTypeCosts, analytic_cost_inputs, topology_bandwidths
from .optimizer import PlanPrice, SearchResult, balance_partitions, price_plan, search
from .profiled_inputs import profiled_cost_inputs, read_cost_tables
from .space import LayerStrategy, decision_trees, strategy_space

__all__ = [
    "CostInputs",
    "LayerStrategy",
    "LayerTypeCosts",
    "PlanPrice",
    "SearchResult",
    "analytic_cost_inputs",
    "balance_partitions",
    "decision_trees",
    "price_plan",
    "profiled_cost_inputs",
    "read_cost_tables",
    "search",
    "strategy_space",
    "topology_bandwidths",
]
