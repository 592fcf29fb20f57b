"""Hypothesis profiles: `ci` (the README's test command) runs every property test's full example
count in a fixed order (`derandomize`: the same examples on every run and machine); `dev`, the
default, runs a quarter of them in random order, for a fast edit-test loop. Tests size their
runs with `examples(n)`; `HYPOTHESIS_PROFILE` picks the profile."""

import os

from hypothesis import settings

PROFILE = os.environ.setdefault("HYPOTHESIS_PROFILE", "dev")
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """`n` examples under the `ci` profile, a quarter of them (at least 5) under `dev`."""
    return n if PROFILE == "ci" else max(5, n // 4)
