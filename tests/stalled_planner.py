"""A cost model that never answers, so a planner built from it hangs (fault tests).

It lives in its own small module because planner workers are spawned processes: they import the
cost model's class by module name, and this one imports nothing heavy.
"""

from __future__ import annotations

import threading
from typing import Any


class NeverAnswers:
    """Wraps a cost model; asking it for cost tables blocks forever, like a stuck planner."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def pipeline_costs(self, recompute: str = "none", **grid_hints: int) -> Any:
        threading.Event().wait()

    def recompute_modes(self) -> list[str]:
        return self.inner.recompute_modes()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()
