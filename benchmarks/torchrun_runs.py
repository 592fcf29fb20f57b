"""Launching the real training program from a benchmark and reading back its per-iteration
log lines, shared by the benchmarks that measure `torchrun ... pretrain_gpt.py` on this
machine (`switch_overhead.py`, `hetero_cpu.py`, `throughput.py`; `free_port` also serves
`cost_model_accuracy.py`'s own torchrun); `iteration_rows` also reads the logs of the real-run
figure scripts (`examples/runs/_collect.py`).

Each run is one `torchrun` with `OMP_NUM_THREADS=1` per rank (the machine is shared); its
stdout holds one line per iteration, in the homogeneous form (`iteration 3/8 | lm loss ... |
tokens/s ... | ... | iteration 412 ms (predicted 9 ms on A100-80GB) ...`) or the heterogeneous
one, which names the strategy and splits the time into pull, propagation, push and optimiser;
`predicted` (the planner's iteration time, ms, or under `--parallel-plan` the search's:
`(search predicted 1,152 ms on cpu ...)`) is None where no planner ran
(`--baseline megatron-1f1b`); `fitted` is the job's online fit of iteration times, once it has
seen a few (`dynapipe_planner.online_fit`). Configurations are run in
alternating order between rounds (`alternating`) because load drifts on a shared machine.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HETERO = re.compile(
    r"iteration +(?P<it>\d+)/\d+ \| strategy (?P<strategy>.+?) \| lm loss (?P<loss>[\d.]+) \| "
    r"tokens/s (?P<tps>[\d,]+) \| .*?iteration (?P<ms>[\d,]+) ms \(pull (?P<pull>[\d,]+), "
    r"propagation (?P<prop>[\d,]+), push (?P<push>[\d,]+), optimizer (?P<opt>[\d,]+) ms"
    r".*?\| predicted (?P<predicted>[\d,.]+) ms"
)
HOMOGENEOUS = re.compile(
    r"iteration +(?P<it>\d+)/\d+ \| lm loss (?P<loss>[\d.]+) \| tokens/s (?P<tps>[\d,]+) \| "
    r"(?:padding eff (?P<eff>[\d.]+) \| micro-batches (?P<mbs>\d+) \| )?"
    r".*?\| iteration (?P<ms>[\d,]+) ms(?: \((?:search )?predicted (?P<predicted>[\d,.]+) ms)?"
)

PEAK_MEMORY = re.compile(r"\| peak memory (?P<peak_mib>[\d,.]+) MiB")
FITTED = re.compile(r"; fitted (?P<fitted>[\d,.]+) ms")


def add_model_args(
    parser, *, hidden_size: int, seq_length: int, num_layers: int = 4, num_attention_heads: int = 4
) -> None:
    """The GPT's flags the benchmarks share, with each benchmark's defaults."""
    parser.add_argument("--num-layers", type=int, default=num_layers)
    parser.add_argument("--hidden-size", type=int, default=hidden_size)
    parser.add_argument("--num-attention-heads", type=int, default=num_attention_heads)
    parser.add_argument("--seq-length", type=int, default=seq_length)


def model_flags(args) -> list[str]:
    """`add_model_args`' values as the Megatron flags `pretrain_gpt.py` takes."""
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length),
    ]  # fmt: skip


def free_port() -> int:
    """A port for a job's rendezvous, free now, that the kernel does not hand out by itself.

    A port the kernel picks (`bind(0)`) is free only until the kernel gives it to the next
    outgoing connection: with tests and benchmarks running side by side (gloo opens many), a
    job's store once lost its port that way (EADDRINUSE). Ports below the ephemeral range
    (`/proc/sys/net/ipv4/ip_local_port_range`) are only ever taken by an explicit bind, so one
    picked at random there and bound once to check stays free unless another job picks the same.
    """
    low = _ephemeral_start()
    chooser = random.SystemRandom()
    for _ in range(100):
        port = chooser.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in [10000, {low})")


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(int(f.read().split()[0]), 10_001)
    except (OSError, ValueError, IndexError):
        return 32768


def _iteration(line: str) -> re.Match | None:
    return HETERO.search(line) or HOMOGENEOUS.search(line)


def iteration_rows(stdout: str) -> list[dict[str, str]]:
    """The fields of every per-iteration line, heterogeneous or homogeneous; `peak_mib` is the
    largest rank's peak memory where `--log-peak-memory` traced the iteration, `fitted` the
    online fit's prediction (ms) where the line shows one, else None."""
    rows = []
    for line in stdout.splitlines():
        match = _iteration(line)
        if match:
            peak, fitted = PEAK_MEMORY.search(line), FITTED.search(line)
            rows.append(
                {
                    **match.groupdict(),
                    "peak_mib": peak and peak["peak_mib"],
                    "fitted": fitted and fitted["fitted"],
                }
            )
    return rows


class RunTimedOut(RuntimeError):
    """A run that did not finish within its time limit (its processes are killed)."""


def run(
    label: str,
    nproc: int,
    argv: Sequence[str],
    warmup_iters: int,
    measured_iters: int,
    timeout_s: float | None = None,
) -> list[dict[str, str]]:
    """One `torchrun --nproc-per-node nproc pretrain_gpt.py argv` (which must train
    warmup_iters + measured_iters iterations); its log lines after the warm-up, each with the
    run's first loss as `first_loss`. A failed run or a missing line ends the benchmark with
    the command and the output; a run past `timeout_s` is killed with all its ranks and raises
    `RunTimedOut`."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errors:
        # A session of its own, so that a timeout kills the ranks too, not only torchrun; each
        # iteration line is read as it comes, with the run's CPU seconds so far (`tree_cpu_s`).
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errors, text=True,
            start_new_session=True,
        )  # fmt: skip
        timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        if timeout_s is not None:
            timer.start()
        lines, cpu_at_line = [], []
        for line in proc.stdout:  # the CPU seconds spent by the time each line is printed
            lines.append(line)
            cpu_at_line.append(tree_cpu_s(proc.pid) if _iteration(line) else None)
        proc.wait()
        timer.cancel()
        if timeout_s is not None and time.perf_counter() - started >= timeout_s:
            print(f"  {label}: killed after {timeout_s:,.0f} s", flush=True)
            raise RunTimedOut(f"{label} did not finish within {timeout_s:,.0f} s")
        errors.seek(0)
        stderr = errors.read()
    stdout = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{' '.join(cmd)}\n{stderr[-4000:]}")
    rows = iteration_rows(stdout)
    if len(rows) != warmup_iters + measured_iters:
        raise SystemExit(f"{label}: expected one line per iteration, got:\n{stdout}")
    marks = [cpu for cpu in cpu_at_line if cpu is not None]  # one per row
    for row, before, after in zip(rows, [None, *marks[:-1]], marks, strict=True):
        row["first_loss"] = rows[0]["loss"]
        row["cpu_s"] = None if before is None else f"{after - before:.4f}"
    load = os.getloadavg()[0]
    print(f"  ran {label} ({time.perf_counter() - started:,.0f} s, load {load:.1f})", flush=True)
    return rows[warmup_iters:]


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of process `root` and all its descendants (torchrun, its
    ranks, which it starts in sessions of their own, the planner workers), including their
    children that ended and were waited for: the CPU work a run has done so far, whatever else
    the machine runs."""
    parent, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        ticks[pid] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        total += ticks.get(pid, 0)
        frontier += [child for child, up in parent.items() if up == pid]
    return total / os.sysconf("SC_CLK_TCK")


def alternating[T](configs: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, config) for every round, forward in even rounds and backward in odd ones."""
    for round_ in range(rounds):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            yield round_, config
