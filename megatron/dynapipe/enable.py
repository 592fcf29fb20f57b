"""`import megatron.dynapipe.enable` in a Megatron-LM program, before it parses its flags:
DynaPipe's flags join Megatron's, and with `--dynamic-micro-batching` DynaPipe plans and
schedules every training iteration of `megatron.training.pretrain` (see `megatron_loop`)."""

from .megatron_loop import install

install()
