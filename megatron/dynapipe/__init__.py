"""Megatron-DynaPipe runtime: runs planner-made per-iteration plans on megatron-core.

`megatron/` has no `__init__.py` (a PEP 420 namespace shared with the megatron-core wheel), so
`megatron.core` and `megatron.dynapipe` import side by side.

Layout by concern: the job (flags, model, process groups, the training loop, checkpoints) at the
top level; `pipeline/` runs a plan's instructions; `hetero/` holds the heterogeneous strategies
and their loop; `data/` turns datasets into global batches and micro-batch tensors. Package
`__init__` files hold only a docstring, so importing a subpackage imports nothing else.
"""
