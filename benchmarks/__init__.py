"""The repository's benchmarks, a package of the repository that is not installed: run each from
the repository root as `python -m benchmarks.<name>` (docs/benchmarks.md); `--smoke` runs its
tiny configuration once, as CI does (`tests/integration/test_benchmark_scripts.py`)."""
