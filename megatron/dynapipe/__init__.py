"""Megatron-DynaPipe runtime: runs planner-made per-iteration plans on megatron-core.

`megatron/` has no `__init__.py` (a PEP 420 namespace shared with the megatron-core wheel), so
`megatron.core` and `megatron.dynapipe` import side by side.
"""
