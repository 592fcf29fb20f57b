"""Sample lengths for the planner: read from dataset files, drawn from SYNTHETIC presets, batched.

Only lengths matter to planning, so this package never touches tokens (and never imports torch).
"""

from .batching import global_batches, sample_batches, sample_tokens, truncate
from .presets import PRESETS, sample_lengths
from .sources import load_lengths

__all__ = [
    "PRESETS",
    "global_batches",
    "load_lengths",
    "sample_batches",
    "sample_lengths",
    "sample_tokens",
    "truncate",
]
