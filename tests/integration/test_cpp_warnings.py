"""The C++ core (and the runtime's bus-error handler, csrc/runtime/) compiles warning-free
under -Wall -Wextra: a syntax-only pass over each extension's sources as one translation unit
(pybind11's headers parsed once per extension, not once per file; the compiler's message still
names the source file and line)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pybind11
import pytest
from paths import ROOT

EXTENSIONS = {"core": ROOT / "csrc", "runtime": ROOT / "csrc" / "runtime"}
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
@pytest.mark.parametrize("extension", sorted(EXTENSIONS))
def test_compiles_without_warnings(extension: str, tmp_path: Path) -> None:
    folder = EXTENSIONS[extension]
    sources = sorted(folder.glob("*.cpp"))
    assert sources, f"no sources in {folder}"
    unit = tmp_path / f"{extension}.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in sources))
    cmd = [
        COMPILER, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
        f"-I{folder}", f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}", str(unit),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
