"""Megatron-DynaPipe planner: per-iteration micro-batching, pipeline schedules and plans.

This package never imports torch; its hot loops live in the C++ module `dynapipe_planner._core`.
"""

__version__ = "0.1.0"
