"""Fork-after-import launcher for multi-rank tests (gloo; NCCL for the GPU lane).

Importing torch and megatron-core costs seconds per process on small machines, so the test
process imports them once and forks the ranks. Each rank runs single-threaded, joins a gloo
group on a fresh local port and sends back its result (or its traceback). A rank that fails,
dies or hangs fails the test with its rank id.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import megatron_parser_memo

from benchmarks.torchrun_runs import free_port

# What the runtime's ranks import, imported once in the test process: each forked rank would
# otherwise import it again (about 1 CPU-second per rank on a small machine).
RANK_MODULES = (
    "megatron.training.training",
    "megatron.dynapipe.training",
    "megatron.dynapipe.layouts.training",
    "megatron.dynapipe.megatron_loop",
    # Megatron's tokenizer builder imports its text tokenizers' package, and with it
    # `transformers`, in every rank: over half of a small run's CPU time when each fork did it.
    "megatron.core.tokenizers.text",
)


def import_rank_modules() -> None:
    """Import `RANK_MODULES` and build Megatron's parser once (`megatron_parser_memo`) before
    ranks are forked; nothing in a test that has not imported megatron-core (planner-only).
    Importing them patches nothing: DynaPipe changes megatron.training only when a program
    runs `import megatron.dynapipe.enable`, in the fork."""
    if "megatron.core" not in sys.modules:
        return
    for name in RANK_MODULES:
        importlib.import_module(name)
    megatron_parser_memo.warm()


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    conn,
    args,
    backend: str,
    timeout_s: float,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            # A rank waits for another as long as the test waits for all of them: a rank busy
            # alone (rank 0 writing a checkpoint) is not a hung one while the test allows it.
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world, *args)
        conn.send((True, result))
    except BaseException:
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()
        stop_children()
        # Skip the parent's atexit handlers (pytest's among them) and gloo teardown barriers.
        os._exit(0)


def stop_children() -> None:
    """End the processes this rank started, as interpreter exit would (os._exit skips it):
    megatron-core's checkpoint writer keeps a multiprocessing manager per rank, and planner
    workers of a run that failed stay up; each would outlive the test (560 MB apiece)."""
    children = mp.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=2)
        if child.is_alive():
            child.kill()
            child.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 90.0,
    may_die: Collection[int] = (),
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` forked ranks; return the results.

    `backend="nccl"` spawns the ranks instead and gives rank r GPU r.

    `fn` and `args` reach the ranks through fork (no pickling); results must be picklable.
    Ranks in `may_die` (fault tests) may end without a result; theirs is then None.
    """
    # CUDA cannot be used in a forked child once the parent has touched it (importing
    # megatron-core may), so NCCL ranks start fresh: their fn and args must pickle.
    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
    if backend != "nccl":
        import_rank_modules()
    port = free_port()
    procs, conns = [], {}
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        rank_args = (fn, rank, world_size, port, send, args, backend, timeout_s)
        proc = ctx.Process(target=_rank_main, args=rank_args)
        proc.start()
        send.close()
        procs.append(proc)
        conns[recv] = rank
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while conns and not failures:
            ready = wait(list(conns), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failures.append(f"ranks {sorted(conns.values())} hung for more than {timeout_s} s")
                break
            for conn in ready:
                rank = conns.pop(conn)
                try:
                    ok, payload = conn.recv()
                except EOFError:
                    procs[rank].join(timeout=1)
                    ok, payload = rank in may_die, f"died (exit code {procs[rank].exitcode})"
                    payload = None if ok else payload
                if ok:
                    results[rank] = payload
                else:
                    failures.append(f"rank {rank} failed:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def program_exit_status(rank: int, world: int, program: str, argv: list[str]) -> int | str | None:
    """Run the program file `program` as `__main__` with `argv` on a forked rank (a `run_ranks`
    fn: torchrun's environment, the rank's process group already up); its exit status."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    return _exit_status_of(program, argv)


def _exit_status_of(program: str, argv: list[str]) -> int | str | None:
    sys.argv = [os.path.basename(program), *argv]
    try:
        runpy.run_path(program, run_name="__main__")
    except SystemExit as stop:
        return stop.code
    return 0


def _forked_program(program: str, argv: list[str], env: dict[str, str], conn) -> None:
    try:
        os.environ.update(env)
        conn.send(_exit_status_of(program, argv))
    finally:
        conn.close()
        stop_children()
        os._exit(0)


def exit_status_before_launch(
    program: str, argv: list[str], world_size: int, timeout_s: float = 120.0
) -> int | str | None:
    """The exit status of `program` run as `__main__` in a forked process that sees torchrun's
    environment for rank 0 of `world_size` but no process group: for inputs refused before
    the program starts its ranks (the program's patches stay in the child)."""
    ctx = mp.get_context("fork")
    import_rank_modules()
    recv, send = ctx.Pipe(duplex=False)
    env = {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"}
    proc = ctx.Process(target=_forked_program, args=(program, argv, env, send))
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            raise AssertionError(f"{program} did not end within {timeout_s} s")
        return recv.recv()
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
