"""A Megatron-LM training program as its users write one for megatron.training 0.19, plus the one
line that enables DynaPipe, placed before the program's other imports. `main(argv, model, data)`
trains a GPT from a classic `model_provider`, or a Llama from a `ModelConfig` in the config
container (megatron.training 0.19's preferred form), with Megatron's own `pretrain` loop,
optimiser, logging and checkpoints, on megatron-core's own datasets (`data="megatron"`),
megatron.training's `SFTDataset` over the `--data-path` JSON-lines conversations (`"sft"`, as
upstream's provider builds it under `--sft`, its lines read with `json` where upstream's reader
needs the `datasets` package), or a dataset that does not say its lengths (`"opaque"`).
`forward_step` is pretrain_gpt.py's, reused as Megatron-LM programs reuse Megatron-LM's: its
`get_batch` reads the iterator on tensor-parallel rank 0 and megatron-core's
`get_batch_on_this_tp_rank` broadcasts the batch. Nothing here knows about DynaPipe but the
import.
"""

# ruff: noqa: I001  (the DynaPipe line stays above the imports it patches)
from __future__ import annotations

import megatron.dynapipe.enable  # noqa: F401  (the one line a Megatron-LM program adds)

import json
import os
import sys

import numpy as np

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import Split, get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.datasets.sft_dataset import SFTDataset
from pretrain_gpt import forward_step  # the repository's, importable from its root


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, **kwargs):
    args = get_args()
    config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )


def _dataset_config(args, blend=None) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        inter_document_masking=args.dataloader_inter_document_masking,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        context_parallel_size=args.context_parallel_size,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = _dataset_config(args, get_blend_from_list(args.data_path))
    kind = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, lambda: True, config
    ).build()


class _ConversationLines:
    """The `messages` of each line of a JSON-lines file (SFTDataset's low-level dataset)."""

    def __init__(self, path: str) -> None:
        with open(path, encoding="utf-8") as lines:
            self.lines = [json.loads(line)["messages"] for line in lines]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> list:
        return self.lines[index]


def sft_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """All lines of the file for training, in their order."""
    args = get_args()
    path = args.data_path[0]
    lines = _ConversationLines(path)
    indices = np.arange(len(lines), dtype=np.int32)
    train = SFTDataset(
        lines, path, indices, train_val_test_num_samples[0], Split.train, _dataset_config(args)
    )
    return train, None, None


class _Opaque:
    """A map-style dataset of Megatron's samples that does not say its lengths."""

    def __init__(self, windows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        return self.windows[index]


def opaque_datasets_provider(train_val_test_num_samples, vp_stage=None):
    train, valid, test = datasets_provider(train_val_test_num_samples, vp_stage)
    return _Opaque(train), valid, test


PROVIDERS = {
    "megatron": datasets_provider,
    "sft": sft_datasets_provider,
    "opaque": opaque_datasets_provider,
}
for provider in PROVIDERS.values():
    provider.is_distributed = True


def main(argv: list[str], model: str = "gpt", data: str = "megatron") -> None:
    sys.argv = ["megatron_lm_program.py", *argv]
    parse_and_validate_args()
    args = get_args()
    provider = PROVIDERS[data]
    if model == "gpt":
        container = pretrain_cfg_container_from_args(args)
        pretrain(container, provider, ModelType.encoder_or_decoder, forward_step, model_provider)
    else:
        model_cfg = gpt_config_from_args(args, core_transformer_config_from_args(args))
        container = pretrain_cfg_container_from_args(args, model_cfg)
        pretrain(container, provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":  # from the root: torchrun -m tests.megatron_lm_program <flags>
    main(sys.argv[1:], os.environ.get("MODEL", "gpt"), os.environ.get("DATA", "megatron"))
