"""Starting helper processes with "spawn" without re-importing the launching script.

Spawn runs the parent's `__main__` file again in every child before the child's own work; for a
training script that means torch and megatron-core: 3-10 s of CPU and ~400 MB per child on a
2-core machine, for children that need none of it (planner workers, checkpoint writers' result
managers, whose code lives in importable modules).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """While inside, spawned children leave `__main__` alone: spawn re-imports the parent's
    main module only when it has a file or a spec, and the stand-in has neither. Only for
    children whose targets and arguments do not pickle references to `__main__`."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
