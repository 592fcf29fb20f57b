"""A training loop on megatron-core alone (no megatron.training), trained with DynaPipe's plans.

    torchrun --nproc-per-node 2 examples/mcore_train_loop.py [DynaPipe flags]

The loop has the shape of upstream Megatron-LM's `examples/run_simple_mcore_train_loop.py`:
initialise the groups, build a GPTModel and its DDP, an optimiser and a dataset, then call a
`forward_backward_func` every iteration and step. The lines marked `# DynaPipe` are the ones
such a loop changes to take DynaPipe's schedule instead of megatron-core's (docs/megatron.md shows
the diff against upstream's file); those marked `# CPU` let it run on CPU ranks too. Its
dataset is variable-length (documents of 16-256 tokens, padded to 256) and says its lengths
through `sample_lengths()`, the protocol of docs/datasets.md. PP=2 on 2 ranks; each line
printed is an iteration's loss per token over the global batch. Megatron's DDP keeps gradients
in `main_grad`, where a torch optimiser does not look: the loop hands them over.
"""

import os
import sys
from functools import partial

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.dynapipe import cpu_compat
from megatron.dynapipe.core_schedule import planned_forward_backward_func  # DynaPipe

SEQ_LENGTH = 256
VOCAB_SIZE = 128
ITERATIONS = int(os.environ.get("ITERATIONS", "5"))


class CountingDocuments(torch.utils.data.Dataset):
    """Documents that count up from a random token by a random step (mod VOCAB_SIZE), 16 to
    SEQ_LENGTH tokens long, each padded to SEQ_LENGTH (no loss on the padding)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(16, SEQ_LENGTH + 1, count)
        self.starts = rng.integers(0, VOCAB_SIZE, count)
        self.steps = rng.integers(1, 4, count)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_lengths(self) -> np.ndarray:
        return self.lengths

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        positions = torch.arange(SEQ_LENGTH + 1)
        tokens = (int(self.starts[index]) + int(self.steps[index]) * positions) % VOCAB_SIZE
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": (positions[:-1] < int(self.lengths[index])).float(),
            "position_ids": positions[:-1],
        }


def initialize_distributed(tensor_parallel: int, pipeline_parallel: int) -> torch.device:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        cpu_compat.install()  # CPU
    if not torch.distributed.is_initialized():  # torchrun's ranks; a test's may have one
        torch.distributed.init_process_group(backend="nccl" if on_gpu else "gloo")
    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    return torch.device("cuda") if on_gpu else torch.device("cpu")


def model_provider() -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)  # DynaPipe: summed, not averaged
    tokens = loss_mask.sum()
    return loss, tokens.int(), {"lm loss": torch.stack([loss.detach(), tokens])}  # DynaPipe


def forward_step_func(data_iterator, model):
    data = next(data_iterator)
    output_tensor = model(
        data["tokens"],
        data["position_ids"],
        None,  # DynaPipe: no dense mask, the packed sequence's boundaries instead
        labels=data["labels"],
        packed_seq_params=data["packed_seq_params"],  # DynaPipe
    )
    return output_tensor, partial(loss_func, data["loss_mask"])


def main() -> list[float]:
    """Train ITERATIONS iterations; the losses per token the last stage saw."""
    device = initialize_distributed(tensor_parallel=1, pipeline_parallel=2)
    model_parallel_cuda_manual_seed(123)
    model = model_provider().to(device)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    train_dataset = CountingDocuments(2000)
    forward_backward_func = planned_forward_backward_func(  # DynaPipe
        model, train_dataset, "--tokens-per-global-batch", "2048",  # DynaPipe
        "--train-iters", str(ITERATIONS), *sys.argv[1:],  # DynaPipe
    )  # fmt: skip
    losses = []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        model.zero_grad_buffer()
        reports = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=None,
            model=model,
            num_microbatches=1,
            seq_length=SEQ_LENGTH,
            micro_batch_size=8,
            forward_only=False,
        )
        for param in model.parameters():
            param.grad = param.main_grad
        optimizer.step()
        if reports:  # the last stage: sum the micro-batches' (loss, tokens)
            loss_sum, tokens = torch.stack([r["lm loss"] for r in reports]).sum(0).tolist()
            losses.append(loss_sum / tokens)
            print(f"iteration {iteration + 1}: lm loss {loss_sum / tokens:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
