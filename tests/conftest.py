"""Shared fixtures: a small GPT-2 style BPE tokenizer trained once per session on the stdlib
corpus (no download anywhere), Megatron's own argument parser, and tools/preprocess_data.py as a
module.

Nothing here imports torch or megatron at module level, so the planner-only suite still runs
without the runtime extra; the fixtures skip when it is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest.mock
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import hypothesis_profiles  # noqa: F401  (registers and loads the Hypothesis profile)
import megatron_parser_memo
import pytest

# Plans in tests must not depend on how fast this machine ran a profile: the runtime's tests plan
# with the analytic model unless they name another (`--dynapipe-cost-model`); the local
# profile's own tests set this back. Forked ranks and torchrun children inherit both.
os.environ["DYNAPIPE_COST_MODEL"] = "analytic"
if "DYNAPIPE_CACHE_DIR" not in os.environ:  # removed at the end of the session
    os.environ["DYNAPIPE_CACHE_DIR"] = OWN_CACHE_DIR = tempfile.mkdtemp(prefix="dynapipe-cache-")
else:
    OWN_CACHE_DIR = None

# The suite starts about a hundred Python processes (xdist workers, torchrun ranks, CLIs). Where
# the machine sets PYTHONDONTWRITEBYTECODE each of them compiled the repository's modules again
# and each worker re-rewrote every test module (9 CPU-s a worker): the first one now writes them.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

megatron_parser_memo.install()

# Every process the suite starts inherits this mark (xdist workers, forked ranks, torchrun and
# its children, spawned planners); the process that set it checks at the end that none of them
# outlives the suite (`pytest_sessionfinish`).
SESSION_MARK = "DYNAPIPE_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, str(os.getpid()))
LEAK_GRACE_S = 15.0  # for children still on their way out when the last test ends


def _marked_processes() -> dict[int, str]:
    """The processes (pid -> command line) carrying this session's mark, except this one and
    the multiprocessing resource tracker it started itself (which ends when it ends)."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if parent == os.getpid() and "resource_tracker" in command:
            continue
        found[int(entry.name)] = command.strip()
    return found


@pytest.hookimpl(trylast=True)  # after xdist has shut its workers down
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run when a process the suite started is still alive at its end (issue 35:
    orphaned ranks and spawned children once held 4 GB after a run); they are killed."""
    if os.environ.get(SESSION_MARK) != str(os.getpid()):
        return
    if OWN_CACHE_DIR is not None:
        shutil.rmtree(OWN_CACHE_DIR, ignore_errors=True)
    if not Path("/proc").is_dir():
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    while (leaked := _marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not leaked:
        return
    for pid, command in leaked.items():
        print(f"\nprocess {pid} outlived the test suite: {command[:200]}", file=sys.stderr)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _cuda_available() -> bool:
    """Asked in a child process: initialising CUDA here would break the forked GPU ranks. A
    machine without an NVIDIA device node has none (and spares the child's torch import)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    probe = "import torch; print(torch.cuda.is_available())"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    except OSError:
        return False
    return out.stdout.strip() == "True"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow tests run first, then the other integration files, then the unit lane:
    under `--dist loadfile` (pyproject's addopts; a file's module fixtures are then computed
    once) xdist hands out whole files in this order, so no long file starts last while the
    other worker idles. The GPU lane (`-m gpu`) is collected everywhere and skipped where
    there is no GPU."""
    heavy = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: (item.path not in heavy, "integration" not in item.path.parts))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="GPU lane: no CUDA device here")
        for item in gpu_items:
            item.add_marker(skip)


BPE_VOCAB_SIZE = 500
BPE_TRAINING_FILES = 50
BPE_EOD = "<|endoftext|>"
PREPROCESS_TOOL = Path(__file__).resolve().parents[1] / "tools" / "preprocess_data.py"


class BpeFiles(NamedTuple):
    """A GPT-2 style byte-level BPE as Megatron's GPT2BPETokenizer reads it."""

    vocab_file: Path  # vocab.json: token -> id, BPE_EOD included
    merge_file: Path  # merges.txt

    def reference(self):
        """The BPE as the `tokenizers` library itself encodes (GPT-2's byte-level scheme)."""
        import tokenizers

        bpe = tokenizers.Tokenizer(
            tokenizers.models.BPE.from_file(str(self.vocab_file), str(self.merge_file))
        )
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        return bpe

    def eod_id(self) -> int:
        return json.loads(self.vocab_file.read_text())[BPE_EOD]

    def flags(self) -> list[str]:
        return [
            "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(self.vocab_file),
            "--merge-file", str(self.merge_file),
        ]  # fmt: skip


@pytest.fixture(scope="session")
def gpt2_bpe(tmp_path_factory: pytest.TempPathFactory) -> BpeFiles:
    """Train a byte-level BPE (vocabulary BPE_VOCAB_SIZE, GPT-2's pre-tokenizer and end-of-text
    token) with the `tokenizers` library on the first BPE_TRAINING_FILES stdlib files, and
    write its vocab.json and merges.txt (about a second)."""
    tokenizers = pytest.importorskip("tokenizers")
    from megatron.dynapipe.data.stdlib_corpus import stdlib_files

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=[BPE_EOD],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train([str(path) for path in stdlib_files()[:BPE_TRAINING_FILES]], trainer)
    directory = tmp_path_factory.mktemp("gpt2-bpe")
    vocab, merges = bpe.model.save(str(directory))
    return BpeFiles(Path(vocab), Path(merges))


@pytest.fixture(scope="session")
def megatron_args() -> Callable[..., argparse.Namespace]:
    """Parse flags with Megatron's own parser (`megatron.training.arguments.parse_args`), as
    the runtime does; `validate_args` is left to the caller."""
    arguments = pytest.importorskip("megatron.training.arguments")

    def parse(*flags: str) -> argparse.Namespace:
        with (
            unittest.mock.patch.object(sys, "argv", ["pretrain_gpt.py", *flags]),
            warnings.catch_warnings(),
        ):
            # Megatron's config-built flags give argparse.BooleanOptionalAction a `type=`,
            # which Python 3.12 deprecates, once per flag.
            warnings.simplefilter("ignore", DeprecationWarning)
            return arguments.parse_args()

    return parse


@pytest.fixture(scope="session")
def preprocess_tool() -> ModuleType:
    """tools/preprocess_data.py imported as the module `preprocess_data` (registered in
    sys.modules: its dataclass and its forked workers look themselves up there)."""
    pytest.importorskip("megatron.core")
    spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS_TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module
    spec.loader.exec_module(module)
    return module
