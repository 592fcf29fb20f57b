"""A faster Megatron parser for the test suite: `install()` memoizes
`megatron.training.argument_utils.ArgumentGroupFactory._get_field_docstrings`, `warm()` fills
the memo before ranks are forked (each rank then builds its parsers in milliseconds)."""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import sys
from types import ModuleType


class _MemoizedFieldDocstrings(importlib.abc.MetaPathFinder):
    """Memoizes `megatron.training.argument_utils.ArgumentGroupFactory._get_field_docstrings`
    when that module is first imported.

    Building Megatron's parser reads and parses the source of every config dataclass
    (`inspect.getsource`, `ast.parse`) to turn field docstrings into help texts: about 0.2 CPU-s
    per parser (0.012 s memoized), 90% of refusing a bad flag, and the suite builds thousands of
    parsers (every case of the input sweep, every forked rank). The result depends only on the
    class, so each process tree computes it once per class; the parser, its flags and its checks
    are Megatron's, as before. The suite's processes and the ranks they fork have it; programs
    started as new processes (torchrun's) do not. It imports nothing: a planner-only run never
    loads megatron."""

    MODULE = "megatron.training.argument_utils"

    def find_spec(self, name, path, target=None):
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)  # the finders after this one find the real module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            _memoize(module)

        spec.loader.exec_module = exec_module
        return spec


def _memoize(module: ModuleType) -> None:
    factory = module.ArgumentGroupFactory
    docstrings = factory._get_field_docstrings
    if getattr(docstrings, "memoized", False):
        return
    memo: dict[type, dict[str, str]] = {}

    def memoized(self, cls: type) -> dict[str, str]:
        if cls not in memo:
            memo[cls] = docstrings(self, cls)
        return dict(memo[cls])

    memoized.memoized = True
    factory._get_field_docstrings = memoized


def install() -> None:
    """Memoize when megatron.training.argument_utils is imported (now, if it already was)."""
    module = sys.modules.get(_MemoizedFieldDocstrings.MODULE)
    if module is not None:
        _memoize(module)
    elif not any(isinstance(f, _MemoizedFieldDocstrings) for f in sys.meta_path):
        sys.meta_path.insert(0, _MemoizedFieldDocstrings())


_warmed: list[bool] = []  # one parser per process fills the memo; later calls do nothing


def warm() -> None:
    """Build Megatron's parser once in this process, so the processes it forks inherit the
    filled memo; nothing when megatron.training's arguments were never imported here."""
    arguments = sys.modules.get("megatron.training.arguments")
    if arguments is not None and not _warmed:
        arguments.add_megatron_arguments(argparse.ArgumentParser())
        _warmed.append(True)
