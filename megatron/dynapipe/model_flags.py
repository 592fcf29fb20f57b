"""Precision and model flags in the forms other parts need: the plan's dtype name, and Megatron's
parsed flags for a `ModelSpec` (tools and tests that start from a spec build the model through
Megatron's parser too, so there is one way to build a model). The spec of parsed flags is
`dynapipe_planner.megatron_model.spec_from_args`.
"""

from __future__ import annotations

import argparse

from dynapipe_planner.megatron_model import model_flags
from dynapipe_planner.model_spec import ModelSpec


def dtype_name(args: argparse.Namespace) -> str:
    """The plan's dtype name for the job's precision flags."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def spec_args(spec: ModelSpec, seq_length: int, *flags: str) -> argparse.Namespace:
    """Megatron's parsed and validated flags for a GPT of shape `spec` (plus `flags`)."""
    from .arguments import parse_args

    return parse_args(
        [*model_flags(spec), "--seq-length", str(seq_length), "--train-iters", "1", *flags]
    )
