"""Run this interpreter's programs (`python -m pkg.mod ...`, `python script.py ...`, `torchrun`)
in processes forked from the test process instead of fresh interpreters.

Importing torch and megatron-core costs about 9 CPU-seconds per process on the 2-core CI
machine; a benchmark that launches `torchrun ... pretrain_gpt.py` five times on four ranks
would pay it 25 times. `ForkedPopen` is a `subprocess.Popen` whose children are forks of the
process that builds it: a command of this interpreter runs its program as `__main__` with
`runpy` in the fork (imports already done), with the pipes, working directory, environment and
session `Popen` was given; other commands run as usual (exec). `python -m torch.distributed.run
--nproc-per-node N [--master-port P] [--standalone] [-m] PROGRAM ARGS` forks a launcher that
forks the N ranks with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and, as torchrun does, stops the others when one fails. Inside every fork
`subprocess.Popen` is `ForkedPopen` too, so what a benchmark launches is forked in turn.

Imports resolve as in the test process (pytest's `pythonpath` holds the repository root), not
from the command's working directory. `run_forked` runs one command to its end, with a time
limit that kills the whole process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import multiprocessing.process
import os
import runpy
import signal
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from distributed import free_port, import_rank_modules, stop_children

TORCHRUN = "torch.distributed.run"
# Popen's own (a fork patches `subprocess.Popen` to `ForkedPopen`, whose signature is *args).
_EXECUTE_CHILD = inspect.signature(subprocess.Popen._execute_child)


def _torchrun_parser() -> argparse.ArgumentParser:
    """The torchrun options the repository's launchers use; any other is an error here, so a
    launcher that starts using one shows up instead of being emulated wrongly."""
    p = argparse.ArgumentParser(prog="torchrun (forked)", allow_abbrev=False)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    p.add_argument("--master-port", "--master_port", type=int, default=None)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--nnodes", choices=["1", "1:1"], default="1")
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("program")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def parse_command(args: Sequence[str]) -> tuple[str, str, list[str], argparse.Namespace | None]:
    """(kind, target, argv, torchrun options) of a command of this interpreter: kind "module"
    (target a module name) or "path" (a script), or ("", "", [], None) for anything else."""
    args = [str(a) for a in args]
    if len(args) < 2 or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return "", "", [], None
    rest = [a for a in args[1:]]
    while rest and rest[0] == "-u":  # unbuffered: every fork's stdout is line-buffered anyway
        rest = rest[1:]
    if not rest or (rest[0].startswith("-") and rest[0] != "-m"):
        return "", "", [], None
    if rest[0] == "-m":
        if len(rest) < 2:
            return "", "", [], None
        if rest[1] == TORCHRUN:
            options = _torchrun_parser().parse_args(rest[2:])
            kind = "module" if options.module else "path"
            return kind, options.program, options.args, options
        return "module", rest[1], rest[2:], None
    return "path", rest[0], rest[1:], None


class ForkedPopen(subprocess.Popen):
    """`subprocess.Popen` that forks this process for this interpreter's commands (module
    docstring); every other command is executed as `Popen` executes it."""

    def _execute_child(self, *args, **kwargs) -> None:
        bound = _EXECUTE_CHILD.bind(self, *args, **kwargs)
        a = bound.arguments
        kind, target, argv, torchrun = parse_command(a["args"] if not a["shell"] else [])
        if not kind or a["preexec_fn"] is not None:
            super()._execute_child(*args, **kwargs)
            return
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = (
            a["p2cread"], a["p2cwrite"], a["c2pread"], a["c2pwrite"], a["errread"], a["errwrite"],
        )  # fmt: skip
        _flush_stdio()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                _forget_parent_children()
                if a["start_new_session"]:
                    os.setsid()
                for fd, target_fd in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, target_fd)
                for fd in {p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite} - {-1, 0, 1, 2}:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if a["cwd"] is not None:
                    os.chdir(a["cwd"])
                if a["env"] is not None:
                    os.environ.clear()
                    os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in a["env"].items()})
                _fresh_stdio()
                subprocess.Popen = ForkedPopen  # what this program launches is forked too
                if torchrun is None:
                    code = _run_program(kind, target, argv)
                else:
                    code = _torchrun(torchrun, kind, target, argv)
            except BaseException:
                traceback.print_exc()
            finally:
                _exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _forget_parent_children() -> None:
    """A fork inherits the parent's record of its multiprocessing children: forgotten, as
    multiprocessing's own children do, so that `stop_children` stops only this process's.
    It inherits the parent's objects too: frozen (`gc.freeze`), so that the garbage collector
    and `gc.get_objects()` see what the program makes, not the test process's whole heap
    (the CPU memory tracer collects and walks the heap at every measurement: seconds each
    over what pytest has imported, and copy-on-write of all of it)."""
    multiprocessing.process._children.clear()
    gc.freeze()


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _fresh_stdio() -> None:
    """Python's streams on this process's descriptors 0-2 (the fork's are the parent's, which
    under pytest are capture objects, with the parent's buffered text)."""
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115


def _exit(code: int) -> None:
    _flush_stdio()
    stop_children()
    os._exit(code)


def _run_program(kind: str, target: str, argv: list[str]) -> int:
    """Run `target` as `__main__` as `python -m target argv` / `python target argv` would;
    its exit status."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:  # what the variable does in a fresh interpreter
        sys.modules["torch"].set_num_threads(int(threads))
    try:
        if kind == "module":
            sys.modules.pop(target, None)  # imported before: run_module would warn
            sys.argv = [target, *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *argv]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _torchrun(options: argparse.Namespace, kind: str, target: str, argv: list[str]) -> int:
    """The launcher: fork the ranks, wait for them; the first to fail stops the others."""
    world = options.nproc_per_node
    port = options.master_port or free_port()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
    )  # fmt: skip
    ranks = {}
    for rank in range(world):
        _flush_stdio()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _forget_parent_children()
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
                code = _run_program(kind, target, argv)
            finally:
                _exit(code)
        ranks[pid] = rank
    failed: tuple[int, int] | None = None
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            for other in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
    if failed is not None:
        print(f"torchrun (forked): rank {failed[0]} exited with {failed[1]}", file=sys.stderr)
        return 1
    return 0


def preimport_runtime() -> bool:
    """Import what the training program's ranks import (`distributed.import_rank_modules`: not
    `megatron.dynapipe.enable`, which would patch this process) and build Megatron's parser
    once, so that every fork inherits both; False where the runtime is not installed."""
    try:
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    import_rank_modules()
    return True


def descendants(root: int) -> list[int]:
    """Every living process under `root` (children first found, whatever their session)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, up in parent.items() if up == pid]
        found += children
        frontier += children
    return found


def run_forked(
    argv: Sequence[str], *, cwd: str | Path, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python argv...` in a fork of this process (stdout and stderr together, as text); past
    `timeout_s` its whole process tree is killed and the test fails with its output."""
    cmd = [sys.executable, *map(str, argv)]
    with ForkedPopen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(
                f"`{' '.join(argv)}` did not end within {timeout_s:.0f} s:\n{out[-4000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out)
