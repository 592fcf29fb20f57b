"""Builds the C++ planning core `dynapipe_planner._core` (sources in csrc/)."""

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

setup(ext_modules=[core], cmdclass={"build_ext": build_ext})
