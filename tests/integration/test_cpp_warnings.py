"""The C++ core (and the runtime's bus-error handler, csrc/runtime/) compiles warning-free
under -Wall -Wextra (a syntax-only pass per source)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pybind11
import pytest
from paths import ROOT

SOURCES = sorted((ROOT / "csrc").glob("**/*.cpp"))
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_without_warnings(source):
    cmd = [
        COMPILER, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
        f"-I{source.parent}", f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}", str(source),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
