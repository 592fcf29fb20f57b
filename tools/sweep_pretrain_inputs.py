"""Bad inputs to `pretrain_gpt.py`, tried and counted (#18).

    python tools/sweep_pretrain_inputs.py [--timeout 60] [--verbose]

Every numeric DynaPipe flag and Megatron's main numeric flags get nan, inf, -1, 0 (where the
flag must be positive), 2**63 (past int64, integers) and a word; the paths get a missing data
prefix, a directory as data, a file or a damaged tracker as `--load`, a `--save` where no
directory can be made, and a missing `--hetero-plan`, `--parallel-plan` or cost table. An
input is *refused* when the program exits with status 2 and one stderr line that names the
flag (or the path), with no traceback and no file written. Anything else is counted: a
traceback, a hang (still running after `--timeout` seconds), a silent acceptance (exit status
0: it trained), or other (printed: wrong status, several lines, the item not named, a file
written).

Each input is first given to `pretrain_gpt.py` run in a forked process, stopped where
torch.distributed would start (`until_process_group`): the program refuses bad flags, data and
checkpoints before that, and this is fast. An input that gets there is then run for real, as
one process of a one-rank job (`WORLD_SIZE=1`, no torchrun), to see what the program does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron.dynapipe.world_of_one import WORLD_OF_ONE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "pretrain_gpt.py"

# One iteration of a tiny GPT on synthetic data, planned inline: about 7 s as a real run.
BASE = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "128", "--dynamic-micro-batching", "--tokens-per-global-batch", "1024",
    "--data-path", "synthetic:flan", "--train-iters", "1", "--lr", "1e-3",
    "--dynapipe-memory-limit-gib", "0.01", "--planner-workers", "0", "--log-interval", "1",
    "--eval-iters", "0",
)  # fmt: skip

WORD = "many"
BAD = {  # by what the flag holds: the values that are not one
    "count": ("nan", "inf", "-1", "0", str(2**63), WORD),  # a positive integer
    "count0": ("nan", "inf", "-1", str(2**63), WORD),  # an integer, 0 allowed
    "positive": ("nan", "inf", "-1", "0", WORD),  # a positive number
    "nonnegative": ("nan", "inf", "-1", WORD),
    "fraction": ("nan", "inf", "-1", "1.5", WORD),  # a probability or decay rate, below 1
}

# flag, kind, flags the flag needs alongside it, BASE flags it replaces
NUMERIC: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    # DynaPipe's
    ("--tokens-per-global-batch", "count", (), ()),
    ("--dynapipe-memory-limit-gib", "positive", (), ()),
    ("--planner-workers", "count0", (), ()),
    ("--dynapipe-timeout", "positive", (), ()),
    ("--strategy-window", "count0", ("--dynamic-strategies",), ()),
    ("--max-cached-strategies", "count0", ("--dynamic-strategies",), ()),
    # Megatron's: model
    ("--num-layers", "count", (), ()),
    ("--hidden-size", "count", (), ()),
    ("--num-attention-heads", "count", (), ()),
    ("--ffn-hidden-size", "count", (), ()),
    ("--kv-channels", "count", (), ()),
    ("--num-query-groups", "count", ("--group-query-attention",), ()),
    ("--seq-length", "count", (), ()),
    ("--max-position-embeddings", "count", (), ()),
    ("--make-vocab-size-divisible-by", "count", (), ()),
    ("--padded-vocab-size", "count", (), ()),
    ("--rotary-base", "count", ("--position-embedding-type", "rope"), ()),
    ("--norm-epsilon", "positive", (), ()),
    ("--init-method-std", "nonnegative", (), ()),
    ("--hidden-dropout", "fraction", (), ()),
    ("--attention-dropout", "fraction", (), ()),
    # parallelism and batch
    ("--tensor-model-parallel-size", "count", (), ()),
    ("--pipeline-model-parallel-size", "count", (), ()),
    ("--micro-batch-size", "count", (), ()),
    ("--global-batch-size", "count", (), ("--tokens-per-global-batch",)),
    ("--train-iters", "count", (), ()),
    ("--train-samples", "count", ("--global-batch-size", "4"),
     ("--tokens-per-global-batch", "--train-iters")),
    # optimiser and schedule
    ("--lr", "nonnegative", (), ()),
    ("--min-lr", "nonnegative", (), ()),
    ("--weight-decay", "nonnegative", (), ()),
    ("--clip-grad", "nonnegative", (), ()),
    ("--adam-beta1", "fraction", (), ()),
    ("--adam-beta2", "fraction", (), ()),
    ("--adam-eps", "positive", (), ()),
    ("--lr-warmup-iters", "count0", (), ()),
    ("--lr-warmup-fraction", "fraction", (), ()),
    ("--lr-decay-iters", "count", (), ()),
    ("--loss-scale", "positive", ("--fp16",), ()),
    ("--initial-loss-scale", "positive", ("--fp16",), ()),
    ("--min-loss-scale", "positive", ("--fp16",), ()),
    ("--loss-scale-window", "positive", ("--fp16",), ()),
    # run control
    ("--seed", "count", (), ()),
    ("--log-interval", "count", (), ()),
    ("--eval-interval", "count", (), ()),
    ("--eval-iters", "count0", (), ()),
    ("--save-interval", "count", ("--save", "ckpt"), ()),
    ("--exit-interval", "count", (), ()),
    ("--exit-duration-in-mins", "count", (), ()),
    ("--manual-gc-interval", "count0", ("--manual-gc",), ()),
    ("--distributed-timeout-minutes", "count", (), ()),
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One bad input: the command line, and the item its error must name."""

    label: str
    argv: tuple[str, ...]
    item: str


@dataclass
class Outcome:
    """What the program did with one input: `kind` is refused, traceback, hang, accepted or
    other; `detail` says why for any but refused."""

    case: Case
    kind: str
    detail: str = ""


def with_flags(add: tuple[str, ...], drop: tuple[str, ...] = ()) -> tuple[str, ...]:
    """BASE without the flags in `drop` (and their values), then `add`; a flag given in both
    BASE and `add` takes `add`'s value."""
    argv, skip = [], False
    replaced = set(drop) | {token for token in add if token.startswith("--")}
    for token in BASE:
        if skip:
            skip = False
            continue
        if token in replaced:
            skip = not token.startswith("--dynamic")  # every BASE flag but that one has a value
            continue
        argv.append(token)
    return (*argv, *add)


def numeric_cases() -> list[Case]:
    """Each flag of NUMERIC with each value its kind must refuse."""
    return [
        Case(f"{flag} {value}", with_flags((*needs, flag, value), drop), flag)
        for flag, kind, needs, drop in NUMERIC
        for value in BAD[kind]
    ]


def path_cases(scratch: Path) -> list[Case]:
    """Bad paths, made under `scratch` (left as they are found)."""
    a_file, a_dir, read_only = scratch / "a_file", scratch / "a_dir", scratch / "read_only"
    a_file.write_text("not a checkpoint\n")
    a_dir.mkdir()
    read_only.mkdir(mode=0o500)
    tracker_dir = scratch / "bad_tracker"
    tracker_dir.mkdir()
    (tracker_dir / "latest_checkpointed_iteration.txt").write_text("seven\n")
    cases = [
        Case("--data-path missing", with_flags(("--data-path", str(scratch / "no_data"))),
             str(scratch / "no_data")),
        Case("--data-path a directory", with_flags(("--data-path", str(a_dir))), str(a_dir)),
        Case("--load a file", with_flags(("--load", str(a_file))), "--load"),
        Case("--load a bad tracker", with_flags(("--load", str(tracker_dir))),
             "latest_checkpointed_iteration.txt"),
        Case("--save a file", with_flags(("--save", str(a_file))), "--save"),
        Case("--save under a file", with_flags(("--save", str(a_file / "ckpt"))), "--save"),
        Case("--dynapipe-cost-model missing",
             with_flags(("--dynapipe-cost-model", str(scratch / "no.json"))),
             str(scratch / "no.json")),
        Case("--hetero-plan missing", with_flags(("--hetero-plan", str(scratch / "no.json"))),
             str(scratch / "no.json")),
        Case("--lr missing", with_flags((), ("--lr",)), "--lr"),
        Case("--parallel-plan missing",
             with_flags(("--parallel-plan", str(scratch / "no.json")),
                        ("--dynamic-micro-batching", "--tokens-per-global-batch")),
             str(scratch / "no.json")),
    ]  # fmt: skip
    if not os.access(read_only, os.W_OK):  # root writes anywhere
        cases.append(
            Case("--save read-only", with_flags(("--save", str(read_only / "ckpt"))), "--save")
        )
    return cases


class Started(Exception):
    """The input got as far as torch.distributed's start."""


def until_process_group(case: Case, workdir: Path, timeout_s: float = 120.0) -> Outcome | None:
    """The program run as `__main__` in a forked process (a one-rank job's environment,
    `workdir` as the current directory) until torch.distributed would start; None when the
    input gets that far. Forked, because the program patches megatron.training (DynaPipe's
    `enable`) and sets Megatron's global state, which must not outlive one input."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run_until_process_group, args=(case.argv, workdir, send))
    child.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            return Outcome(case, "hang", f"still running after {timeout_s:g} s")
        kind, status, stderr = recv.recv()
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
    if kind == "started":
        return None
    if kind == "traceback":
        return Outcome(case, "traceback", stderr)
    return judge(case, status, stderr, workdir)


def _run_until_process_group(argv: tuple[str, ...], workdir: Path, conn) -> None:
    import torch.distributed as dist

    def stop(*args, **kwargs) -> None:
        raise Started

    err = io.StringIO()
    sys.argv, dist.init_process_group = [str(SCRIPT), *argv], stop
    os.environ.update(WORLD_OF_ONE)
    os.environ.pop("DYNAPIPE_DEBUG", None)
    os.chdir(workdir)
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            try:
                runpy.run_path(str(SCRIPT), run_name="__main__")
                result = ("ended", 0, err.getvalue())
            except SystemExit as e:
                result = ("ended", e.code if isinstance(e.code, int) else 1, err.getvalue())
    except Started:
        result = ("started", 0, "")
    except Exception as e:
        result = ("traceback", 1, f"{type(e).__name__}: {e}")
    conn.send(result)
    conn.close()
    os._exit(0)


def real_run(case: Case, workdir: Path, timeout_s: float) -> Outcome:
    """The input given to a real one-rank `pretrain_gpt.py` process."""
    env = {**os.environ, **WORLD_OF_ONE}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("DYNAPIPE_DEBUG", None)
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *case.argv],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s,
            start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Outcome(case, "hang", f"still running after {timeout_s:g} s")
    return judge(case, done.returncode, done.stderr, workdir)


def judge(case: Case, status: int, stderr: str, workdir: Path) -> Outcome:
    """Refused, or the first thing wrong: a traceback, an accepted input, or other."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in stderr:
        return Outcome(case, "traceback", lines[-1])
    if status == 0:
        return Outcome(case, "accepted", "exit status 0")
    written = sorted(p.name for p in workdir.iterdir())
    problems = []
    if status != 2:
        problems.append(f"exit status {status}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines")
    elif case.item not in lines[0]:
        problems.append(f"{case.item} not named")
    if written:
        problems.append(f"wrote {written}")
    if problems:
        return Outcome(case, "other", "; ".join(problems) + (f": {lines[-1]}" if lines else ""))
    return Outcome(case, "refused", lines[0])


def sweep(timeout_s: float, scratch: Path) -> Iterator[Outcome]:
    for case in [*numeric_cases(), *path_cases(scratch)]:
        workdir = Path(tempfile.mkdtemp(dir=scratch, prefix="run-"))
        outcome = until_process_group(case, workdir) or real_run(case, workdir, timeout_s)
        shutil.rmtree(workdir)
        yield outcome


def summary(counts: Counter) -> str:
    return (
        f"inputs tried {counts.total()} | refused {counts['refused']} | tracebacks "
        f"{counts['traceback']} | hangs {counts['hang']} | silently accepted "
        f"{counts['accepted']} | other {counts['other']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a real run may take")
    parser.add_argument("--verbose", action="store_true", help="print refused inputs too")
    args = parser.parse_args(argv)
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        try:
            for outcome in sweep(args.timeout, Path(tmp)):
                counts[outcome.kind] += 1
                if outcome.kind != "refused" or args.verbose:
                    print(f"{outcome.kind:>9}  {outcome.case.label}: {outcome.detail}", flush=True)
        finally:
            for path in Path(tmp).rglob("*"):  # the read-only directory, removable again
                if path.is_dir():
                    path.chmod(0o700)
    print(summary(counts))
    return 0 if counts.total() == counts["refused"] else 1


if __name__ == "__main__":
    sys.exit(main())
