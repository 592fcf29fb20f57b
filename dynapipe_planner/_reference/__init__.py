"""Readable pure-Python twins of the C++ core's kernels (`csrc/`), one module per kernel family.

Each twin does, step for step and in the same floating-point order, what its C++ kernel does, so
the tests can hold the core to it (C++ == Python, bit for bit) and a reader can follow the
algorithm without reading C++. They are too slow to plan with: the package never imports this
subpackage at run time (`tests/unit/test_import_graph.py` checks), only tests and benchmarks do.
"""
