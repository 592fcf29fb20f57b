"""Freeze or kill one rank of a running `pretrain_gpt.py` job, many times, and count how it ends.

    python tools/fault_trials.py [--trials 10] [--timeout 20] [--signals STOP KILL]

Each trial launches the README's job (scaled down: 2 CPU ranks, PP=2, DynaPipe's plans) under
torchrun with `--dynapipe-timeout`, waits for a seeded random iteration line, then sends the
signal to one rank (SIGSTOP freezes it whole, heartbeats included; SIGKILL ends it). A trial
*ends well* when a surviving rank printed a `pretrain_gpt.py: error:` line naming the signalled
rank within the timeout + 30 s of the signal and the job ended (torchrun waits 30 s more
before it kills a frozen rank). Anything else is a hang (still running at 3x the timeout + 60 s,
then killed), or other (printed). The table counts each (signal, rank) pair.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
JOB = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "256", "--pipeline-model-parallel-size", "2", "--dynamic-micro-batching",
    "--tokens-per-global-batch", "2048", "--train-iters", "400", "--lr", "1e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--dynapipe-memory-limit-gib", "1",
    "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip
ITERATION = re.compile(rb"iteration +(\d+)/")


@dataclass
class Trial:
    signal: str
    rank: int
    at_iteration: int
    outcome: str  # "ends well", "hang", or what else happened
    said_s: float  # from the signal to the surviving rank's error line
    ended_s: float  # from the signal to torchrun's exit (a frozen rank: + torchrun's 30 s)
    line: str


def _rank_process(torchrun: psutil.Process, rank: int) -> psutil.Process | None:
    """The worker of `rank` among torchrun's own children (by its RANK variable; the rank's
    own children, such as rank 0's planner workers, inherit it)."""
    for child in torchrun.children():
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def run_trial(sig: str, rank: int, at: int, timeout_s: float, port: int) -> Trial:
    """One trial: signal `rank` once the job printed iteration `at`."""
    with tempfile.TemporaryDirectory() as scratch:
        err_path = Path(scratch) / "stderr"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), str(ROOT / "pretrain_gpt.py"), *JOB,
            "--dynapipe-timeout", str(timeout_s),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with err_path.open("wb") as err:
            job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
            torchrun = psutil.Process(job.pid)
            seen = 0
            assert job.stdout is not None
            for line in iter(job.stdout.readline, b""):
                match = ITERATION.search(line)
                seen = int(match.group(1)) if match else seen
                if seen >= at:
                    break
            target = _rank_process(torchrun, rank)
            if target is None or job.poll() is not None:
                why = "job ended before the signal" if job.poll() is not None else "no rank process"
                job.kill()
                job.wait()
                last = err_path.read_text(errors="replace").strip().splitlines() or [""]
                return Trial(sig, rank, at, why, 0.0, 0.0, last[-1][:200])
            target.send_signal(getattr(signal, f"SIG{sig}"))
            sent = time.monotonic()
            drain = threading.Thread(target=job.stdout.read, daemon=True)  # keep the pipe open
            drain.start()
            said = None  # seconds from the signal to the first error line
            outcome = None
            while job.poll() is None:
                if said is None and b"pretrain_gpt.py: error:" in err_path.read_bytes():
                    said = time.monotonic() - sent
                if time.monotonic() - sent > 3 * timeout_s + 60:
                    outcome = "hang"
                    for child in torchrun.children(recursive=True):
                        child.kill()
                    job.kill()
                    job.wait()
                    break
                time.sleep(0.2)
            spent = time.monotonic() - sent
            if said is None and b"pretrain_gpt.py: error:" in err_path.read_bytes():
                said = spent
        errors = [
            line
            for line in err_path.read_text(errors="replace").splitlines()
            if line.startswith("pretrain_gpt.py: error:")
        ]
    named = [line for line in errors if f"rank {rank} " in line or f"rank {rank}:" in line]
    if outcome is None:
        if not named:
            outcome = f"no line naming rank {rank} ({len(errors)} error lines)"
        elif said is None or said > timeout_s + 30:
            outcome = "line too late"
        else:
            outcome = "ends well"
    return Trial(sig, rank, at, outcome, said or 0.0, spent, (named or errors or [""])[0][:200])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="per signal and rank")
    parser.add_argument("--timeout", type=float, default=20.0, help="--dynapipe-timeout (s)")
    parser.add_argument("--signals", nargs="+", default=["STOP", "KILL"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    counts: Counter[tuple[str, int, str]] = Counter()
    for sig in args.signals:
        for rank in args.ranks:
            for _ in range(args.trials):
                at = rng.randint(2, 20)
                trial = run_trial(sig, rank, at, args.timeout, args.port)
                counts[(sig, rank, trial.outcome)] += 1
                print(
                    f"SIG{sig} rank {rank} at iteration {at}: {trial.outcome}, line after "
                    f"{trial.said_s:.1f} s, job ended after {trial.ended_s:.1f} s | {trial.line}",
                    flush=True,
                )
    print("\nsignal  rank  outcome                                   trials")
    for (sig, rank, outcome), n in sorted(counts.items()):
        print(f"SIG{sig:<5} {rank:>4}  {outcome:<40} {n:>6}")
    return 0 if all(outcome == "ends well" for _, _, outcome in counts) else 1


if __name__ == "__main__":
    sys.exit(main())
