"""`import megatron.dynapipe.enable` in a Megatron-LM program, before it parses its flags:
DynaPipe's flags join Megatron's, and with `--dynamic-micro-batching` DynaPipe plans and
schedules every training iteration of `megatron.training.pretrain` (see `megatron_loop`).

Before megatron-core is imported, its notices about each optional GPU package it falls back
from (TransformerEngine, Apex), and torch's about CUDA and pinned memory on machines without
them, are silenced: a CPU rank would print a screenful of them, and an error must stay one line.
Then every hook in `megatron_hooks.HOOKS` is installed, and on a machine without CUDA the
CUDA devices torch calls name are redirected to the CPU as well (`cpu_compat`).
"""

import logging
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.(core|training)")
warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accel")
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is dep")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from . import cpu_compat, megatron_hooks  # noqa: E402

megatron_hooks.install()
cpu_compat.install()
