"""Builds the C++ planning core `dynapipe_planner._core` (csrc/*.cpp) and the runtime's bus-error
report `megatron.dynapipe._bus_error` (csrc/runtime/)."""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# One compiler per core (the sources are independent): halves the install on a 2-core machine.
# DYNAPIPE_BUILD_JOBS overrides the count.
ParallelCompile("DYNAPIPE_BUILD_JOBS").install()

core = Pybind11Extension(
    "dynapipe_planner._core",
    sorted(glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    # fp-contract=off keeps C++ arithmetic bit-identical to the Python references.
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-ffp-contract=off"],
)
bus_error = Pybind11Extension(
    "megatron.dynapipe._bus_error",
    ["csrc/runtime/bus_error.cpp"],
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall", "-Wextra"],
)

setup(ext_modules=[core, bus_error], cmdclass={"build_ext": build_ext})
