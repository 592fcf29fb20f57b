"""`pretrain_gpt.py --parallel-plan FILE`: train the plan `dynapipe-search --output` wrote.

A Galvatron-BMW plan (seed `galvatron_bmw.txt`) gives every layer a strategy from the decision
trees of §III-B (DP, SDP, TP, CKPT), splits the layers over the pipeline stages with the
bi-objective partition of §IV-B (any layer count per stage) and fixes the micro-batch count and
the global batch (§IV-A). `apply_parallel_plan` reads the file (`dynapipe_planner.search.
plan_file`), holds it against the job (GPU count, model, sequence length) and turns it into the
runtime's settings:

- TP and PP degrees, and the data-parallel degree the remaining ranks give; DP layers are
  replicated with their gradients all-reduced (Megatron DDP, as in every homogeneous job);
- SDP layers (ZeRO-3 over the whole data-parallel group, `SearchedPlan.sharded_layers`): their
  parameters, gradients and optimiser states sharded by torch FSDP2, one unit per layer, inside
  the same stage's DDP (`sharded_layers`, which says why FSDP2 and not megatron-core's FSDP);
  the embedding and output layer stay replicated. The gradient norm for clipping counts every
  sharded and replicated gradient once. Megatron's checkpoints cannot hold the sharded layers,
  so such a plan refuses --save/--load, and --use-distributed-optimizer (ZeRO-1 over DTensor
  shards);
- the partition: `parallel_state.initialize(layer_counts=...)`, which the model builder hands
  to megatron-core as a pipeline layout;
- the batch: `global_batch_size` samples in micro-batches of `microbatch_size / DP` samples
  per data-parallel rank, padded to their longest sample (`--batching padding`), in 1F1B;
- CKPT: the plan's layers, exactly (`SearchedPlan.checkpointed_layers`, applied by
  `pipeline.recompute.checkpoint_layers` when the stage is built); no other recomputation.

Plans that need what the runtime does not run yet (hybrid DP x SDP layers, TP changing between
layers, strided TP groups) stop with a `PlanFileError` naming the layer
(`plan_file.parallel_plan_refusal`); so do plans for another GPU count, model or sequence
length. Each is one line and exit status 2.
"""

from __future__ import annotations

import argparse

from dynapipe_planner.megatron_model import spec_from_args
from dynapipe_planner.search.plan_file import PlanFileError, SearchedPlan, check_job, load_plan


def apply_parallel_plan(args: argparse.Namespace, world_size: int) -> SearchedPlan:
    """Load `args.parallel_plan`, check it against this job of `world_size` ranks and set the
    parallel sizes and the batch it names on `args`, which Megatron's model builder, optimiser
    and micro-batch calculator read (a `PlanFileError` if it does not fit). Its batching and
    recomputation are the job's already (`JobConfig`: padding, the plan's layers only)."""
    plan = load_plan(args.parallel_plan)
    check_job(plan, spec_from_args(args, plan.model.vocab_size), world_size, args.seq_length)
    if plan.sharded_layers:
        _check_sharded_job(args, plan)
    args.tensor_model_parallel_size = plan.tp
    # derived from the TP degree when the flags were parsed; megatron-core checks the pair
    args.tensor_parallel_num_weight_shards = plan.tp * args.gtp_weight_remat_size
    args.pipeline_model_parallel_size = plan.pp
    args.data_parallel_size = plan.data_degree
    args.global_batch_size = plan.global_batch_size
    args.micro_batch_size = plan.microbatch_size // plan.data_degree
    return plan


def describe(plan: SearchedPlan) -> str:
    """The start-up note naming what `plan` sets."""
    return (
        f"--parallel-plan {plan.path}: TP {plan.tp}, PP {plan.pp} with layers "
        f"{list(plan.partition)}, DP {plan.data_degree}; global batch {plan.global_batch_size} "
        f"in micro-batches of {plan.microbatch_size // plan.data_degree} per data-parallel "
        f"rank; recomputing layers {list(plan.checkpointed_layers)}; sharding (SDP) layers "
        f"{list(plan.sharded_layers)}"
    )


def _check_sharded_job(args: argparse.Namespace, plan: SearchedPlan) -> None:
    """What a job with SDP layers cannot do, refused before it starts."""
    layers = f"plan {plan.path} shards layers {list(plan.sharded_layers)} (SDP, torch FSDP2)"
    if args.save or args.load:
        flag = "--save" if args.save else "--load"
        raise PlanFileError(
            f"{flag}: {layers}, whose sharded parameters Megatron's checkpoint format does not "
            "hold; drop the flag"
        )
    if args.use_distributed_optimizer:
        raise PlanFileError(
            f"--use-distributed-optimizer: {layers}; the plan shards its own states per layer"
        )
