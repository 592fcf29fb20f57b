"""Helpers of the real-run scripts (`examples/runs/*.sh`), run as `python -m examples.runs.<name>`
with the repository root on the path."""
