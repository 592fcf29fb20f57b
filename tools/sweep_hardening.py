"""Hostile and careless inputs to every command the project ships, tried and counted (#34).

    python tools/sweep_hardening.py [--only SUBSTRING] [--timeout 180] [--verbose]

Cases cover the five planner CLIs, `pretrain_gpt.py` (one rank, no torchrun) and
`tools/preprocess_data.py`: device nodes, directories and FIFOs where files go, endless or huge
inputs (`/dev/zero`, `.npy` headers, YAML alias bombs), numbers past int64 or with thousands of
digits, deep JSON/YAML nesting, non-finite values, wrong field types in data, budgets below one
sequence, checkpoints that name no iteration, and half-precision saves that must work.

A case passes when the command ends with its expected status: 2 for a refusal with exactly one
`error:` line on stderr, 0 for a case that must work, and in every case no traceback, no
signal, no hang (`--timeout`), resident memory under `MEMORY_CAP` (the process tree is watched
and killed past it) and every device node it was pointed at still a device. The table counts
outcomes by command; `--verbose` prints every case's last stderr line.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MEMORY_CAP = 4 << 30
DEVICES = ("/dev/full", "/dev/null", "/dev/zero")

PLAN = [
    str(BIN / "dynapipe-plan"),
    "--model",
    "gpt-350m",
    "--gpu",
    "A100-40GB",
    "--pipeline-model-parallel-size",
    "2",
    "--seq-length",
    "1024",
    "--tokens-per-global-batch",
    "8192",
    "--batching",
    "dynamic",
]
PRESET = ["--preset", "flan", "--num-samples", "200"]
SIMULATE = [str(BIN / "dynapipe-simulate")]
PROPOSE = [str(BIN / "dynapipe-strategy"), "propose", "--num-gpus", "8", "--model", "gpt-350m"]
SEARCH = [
    str(BIN / "dynapipe-search"),
    "--model",
    "gpt-350m",
    "--num-gpus",
    "4",
    "--memory-limit-gib",
    "20",
    "--global-batch-size",
    "8",
    "--quiet",
]
HETERO = [
    str(BIN / "dynapipe-hetero"),
    "--model",
    "gpt-350m",
    "--global-batch-size",
    "8",
    "--seq-length",
    "1024",
    "--max-plans",
    "40",
    "--quiet",
]
CLUSTER = str(ROOT / "examples" / "clusters" / "mixed_8gpu.yaml")
PRETRAIN = [
    sys.executable,
    str(ROOT / "pretrain_gpt.py"),
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--train-iters",
    "1",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
]
DYNAPIPE = [
    "--dynamic-micro-batching",
    "--tokens-per-global-batch",
    "1024",
    "--dynapipe-memory-limit-gib",
    "0.01",
    "--planner-workers",
    "0",
]
PREPROCESS = [sys.executable, str(ROOT / "tools" / "preprocess_data.py")]  # fmt: skip

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = str(2**70)
DIGITS = "7" * 5000


@dataclass
class Case:
    name: str
    argv: list[str]  # "{d}" stands for the case's scratch directory
    expect: int = 2
    files: dict[str, str | bytes] = field(default_factory=dict)  # scratch files to create
    setup: Callable[[Path], None] | None = None


def _npy_header(elements: int) -> bytes:
    """A valid `.npy` header declaring `elements` int64 values, and no data."""
    header = f"{{'descr': '<i8', 'fortran_order': False, 'shape': ({elements},), }}"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda d: os.mkfifo(d / name)


def _valid_plan(d: Path) -> None:
    subprocess.run([*PLAN, *PRESET, "--output-dir", str(d / "plans")], check=True,
                   capture_output=True)  # fmt: skip


def _jsonl(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


ALIAS_BOMB = (
    "a: &a ["
    + ",".join(["x"] * 10)
    + "]\n"
    + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 10) + "]\n"
        for i in range(9)
    )
)
LONG_TAILED = _jsonl(*({"text": "word " * n} for n in (5, 9, 3000, 12, 7000, 20) * 20))


def cases() -> list[Case]:
    out: list[Case] = []
    add = out.append
    # dynapipe-plan: lengths files
    for name, content in [
        ("zeros", None), ("5000 digits", DIGITS + "\n"), ("past int64", HUGE_INT + "\n"),
        ("negative", "-5\n"), ("nan", "nan\n"), ("empty", ""), ("words", "ten\n"),
        ("text 12345", _jsonl({"text": 12345})), ("ids string", _jsonl({"input_ids": "hello"})),
        ("ids nested", _jsonl({"input_ids": [[1, 2], [3]]})),
        ("length 1.5", _jsonl({"length": 1.5})),
        ("length true", _jsonl({"length": True})), ("deep", DEEP + "\n"),
        ("length 2^70", _jsonl({"length": 2**70})), ("invalid utf-8", b"\xff\xfe\x00\n"),
    ]:  # fmt: skip
        if content is None:
            add(Case("plan --lengths /dev/zero", [*PLAN, "--lengths", "/dev/zero"]))
            continue
        suffix = ".jsonl" if isinstance(content, str) and content.startswith(("{", "[")) else ".txt"
        add(Case(f"plan lengths {name}", [*PLAN, "--lengths", "{d}/l" + suffix],
                 files={"l" + suffix: content}))  # fmt: skip
    add(Case("plan lengths a directory", [*PLAN, "--lengths", "{d}"]))
    add(Case("plan lengths a fifo", [*PLAN, "--lengths", "{d}/f"], setup=_fifo("f")))
    add(Case("plan npy 10^13 elements", [*PLAN, "--lengths", "{d}/l.npy"],
             files={"l.npy": _npy_header(10**13)}))  # fmt: skip
    add(Case("plan npy float nan", [*PLAN, "--lengths", "{d}/l.npy"], setup=lambda d: np.save(
        d / "l.npy", np.array([5.0, np.nan]))))  # fmt: skip
    add(
        Case(
            "plan npy 2-d",
            [*PLAN, "--lengths", "{d}/l.npy"],
            setup=lambda d: np.save(d / "l.npy", np.ones((3, 3), dtype=np.int64)),
        )
    )
    for dev in ("/dev/full", "/dev/null"):
        add(Case(f"plan --output-dir {dev}", [*PLAN, *PRESET, "--output-dir", dev]))
    add(Case("plan --output-dir a file", [*PLAN, *PRESET, "--output-dir", "{d}/f"],
             files={"f": "keep me"}))  # fmt: skip
    for name, content in [
        ("zeros", None),
        ("deep", DEEP),
        ("nan", '{"a": NaN}'),
        ("2^70", f'{{"hidden_size": {HUGE_INT}}}'),
        ("not json", "]"),
    ]:
        src = "/dev/zero" if content is None else "{d}/m.json"
        files = {} if content is None else {"m.json": content}
        add(Case(f"plan --cost-table {name}", [*PLAN, *PRESET, "--cost-table", src], files=files))
        model = [x if x != "gpt-350m" else src for x in PLAN]
        add(Case(f"plan --model {name}", [*model, *PRESET], files=files))
    for flag, value in [
        ("--tokens-per-global-batch", str(2**63)),
        ("--tokens-per-global-batch", "1"),
        ("--memory-limit-gib", "nan"),
        ("--memory-limit-gib", "-1"),
        ("--memory-limit-gib", "inf"),
        ("--num-samples", str(10**12)),
        ("--gpu", "H900"),
        ("--pipeline-model-parallel-size", "0"),
        ("--iterations", str(2**63)),
        ("--seed", "-1"),
        ("--tensor-model-parallel-size", DIGITS),
        ("--seq-length", str(10**15)),
    ]:
        add(Case(f"plan {flag} {value[:12]}", [*PLAN, *PRESET, flag, value]))
    # dynapipe-simulate
    add(Case("simulate /dev/zero", [*SIMULATE, "/dev/zero"]))
    add(Case("simulate a directory", [*SIMULATE, "{d}"]))
    add(Case("simulate a fifo", [*SIMULATE, "{d}/f"], setup=_fifo("f")))
    add(Case("simulate garbage", [*SIMULATE, "{d}/p"], files={"p": os.urandom(4096)}))
    add(Case("simulate deep json", [*SIMULATE, "{d}/p.json"], files={"p.json": DEEP}))
    add(Case("simulate missing", [*SIMULATE, "{d}/none.json"]))
    plan = "{d}/plans/iter_00000.json"
    add(Case("simulate truncated plan", [*SIMULATE, plan], setup=lambda d: (
        _valid_plan(d), _truncate(d / "plans" / "iter_00000.json"))))  # fmt: skip
    add(Case("simulate a valid plan", [*SIMULATE, plan], 0, setup=_valid_plan))
    for dev in ("/dev/full", "/dev/null"):
        add(Case(f"simulate --png {dev}", [*SIMULATE, plan, "--png", dev], setup=_valid_plan))
        add(Case(f"simulate --trace {dev}", [*SIMULATE, plan, "--trace", dev], setup=_valid_plan))
    add(Case("simulate --png a directory", [*SIMULATE, plan, "--png", "{d}"], setup=_valid_plan))
    add(Case("simulate --trace a fifo", [*SIMULATE, plan, "--trace", "{d}/f"],
             setup=lambda d: (_valid_plan(d), _fifo("f")(d))))  # fmt: skip
    add(Case("simulate --trace no dir", [*SIMULATE, plan, "--trace", "{d}/no/t.json"],
             setup=_valid_plan))  # fmt: skip
    # dynapipe-strategy propose
    flan = ["--preset", "webcode", "--num-samples", "500"]
    for dev in ("/dev/full", "/dev/null"):
        add(Case(f"strategy --output {dev}", [*PROPOSE, *flan, "--output", dev]))
    add(Case("strategy --output a directory", [*PROPOSE, *flan, "--output", "{d}"]))
    add(Case("strategy --lengths /dev/zero", [*PROPOSE, "--lengths", "/dev/zero"]))
    add(Case("strategy lengths 5000 digits", [*PROPOSE, "--lengths", "{d}/l.txt"],
             files={"l.txt": DIGITS}))  # fmt: skip
    add(Case("strategy lengths deep jsonl", [*PROPOSE, "--lengths", "{d}/l.jsonl"],
             files={"l.jsonl": DEEP}))  # fmt: skip
    for flag, value in [
        ("--seq-length", str(10**15)),
        ("--tokens-per-global-batch", "1"),
        ("--memory-limit-gib", "-1"),
        ("--num-gpus", str(2**63)),
        ("--length-step", "0"),
        ("--max-tp", "nan"),
        ("--gpu", "TPU"),
    ]:
        add(Case(f"strategy {flag} {value[:12]}", [*PROPOSE, *flan, flag, value]))
    # dynapipe-search
    for flag, value in [
        ("--seq-length", str(10**15)),
        ("--max-batch-size", str(2**62)),
        ("--memory-limit-gib", "nan"),
        ("--global-batch-size", str(10**12)),
        ("--num-gpus", str(2**40)),
        ("--memory-bins", str(10**9)),
        ("--overlap-slowdown", "inf"),
        ("--max-tp", "-4"),
        ("--pipeline-model-parallel-size", DIGITS),
    ]:
        add(Case(f"search {flag} {value[:12]}", [*SEARCH, flag, value]))
    for dev in ("/dev/full", "/dev/null"):
        add(Case(f"search --output {dev}", [*SEARCH, "--output", dev]))
    add(Case("search --output a directory", [*SEARCH, "--output", "{d}"]))
    add(Case("search --cost-table /dev/zero", [*SEARCH, "--cost-table", "/dev/zero"]))
    add(Case("search --model deep json", [*SEARCH[:2], "{d}/m.json", *SEARCH[3:]],
             files={"m.json": DEEP}))  # fmt: skip
    # dynapipe-hetero
    cluster = Path(CLUSTER).read_text()
    for name, content in [
        ("zeros", None), ("deep yaml", DEEP), ("alias bomb", ALIAS_BOMB),
        ("negative latency", cluster.replace("latency_us: 30", "latency_us: -30", 1)),
        ("nan bandwidth", cluster.replace("bandwidth_gbs: 1.25", "bandwidth_gbs: .nan", 1)),
        ("2^70 GPUs", cluster.replace("count: 4}", f"count: {HUGE_INT}}}", 1)),
        ("not a mapping", "- 1\n- 2\n"), ("empty", ""),
    ]:  # fmt: skip
        src = "/dev/zero" if content is None else "{d}/c.yaml"
        files = {} if content is None else {"c.yaml": content}
        add(Case(f"hetero --cluster {name}", [*HETERO, "--cluster", src], files=files))
    add(Case("hetero --cluster a directory", [*HETERO, "--cluster", "{d}"]))
    add(Case("hetero --cluster missing", [*HETERO, "--cluster", "{d}/none.yaml"]))
    for dev in ("/dev/full", "/dev/null"):
        add(Case(f"hetero --output {dev}", [*HETERO, "--cluster", CLUSTER, "--output", dev]))
    for flag, value in [
        ("--seq-length", str(10**15)),
        ("--global-batch-size", str(2**63)),
        ("--tau", "nan"),
        ("--max-plans", "-1"),
        ("--max-dp", DIGITS),
    ]:
        add(Case(f"hetero {flag} {value[:12]}", [*HETERO, "--cluster", CLUSTER, flag, value]))
    # pretrain_gpt.py, one rank
    data = ["--data-path", "{d}/data.jsonl"]
    for name, content in [
        ("text 12345", _jsonl({"text": 12345})), ("ids string", _jsonl({"input_ids": "hello"})),
        ("ids nested", _jsonl({"input_ids": [[1, 2], [3]]})), ("deep", DEEP + "\n"),
        ("ids past int64", _jsonl({"input_ids": [2**70]})), ("empty", ""),
    ]:  # fmt: skip
        add(Case(f"pretrain jsonl {name}", [*PRETRAIN, *DYNAPIPE, *data],
                 files={"data.jsonl": content}))  # fmt: skip
    add(Case("pretrain longest sample fits nowhere", [
        *PRETRAIN, *DYNAPIPE[:-3], "--dynapipe-memory-limit-gib", "0.0001", "--seq-length", "8192",
        "--max-position-embeddings", "8192", "--tokens-per-global-batch", "16384", *data],
        files={"data.jsonl": LONG_TAILED}))  # fmt: skip
    synthetic = ["--data-path", "synthetic:flan"]
    for flag, value in [
        ("--tokens-per-global-batch", "1"),
        ("--seq-length", str(10**15)),
        ("--dynapipe-memory-limit-gib", "1e300"),
        ("--dynapipe-timeout", "nan"),
        ("--dynapipe-timeout", "1e300"),
        ("--dynapipe-memory-limit-gib", "-1"),
    ]:
        add(Case(f"pretrain {flag} {value[:12]}", [*PRETRAIN, *DYNAPIPE, *synthetic, flag,
                                                   value]))  # fmt: skip
    for flag in ("--hetero-plan", "--parallel-plan", "--dynapipe-cost-model"):
        add(Case(f"pretrain {flag} /dev/zero", [*PRETRAIN, *DYNAPIPE, *synthetic, flag,
                                                "/dev/zero"]))  # fmt: skip
        add(Case(f"pretrain {flag} deep json", [*PRETRAIN, *DYNAPIPE, *synthetic, flag,
                                                "{d}/p.json"], files={"p.json": DEEP}))  # fmt: skip
    add(Case("pretrain --dynapipe-cost-model nan", [*PRETRAIN, *DYNAPIPE, *synthetic,
             "--dynapipe-cost-model", "{d}/t.json"], files={"t.json": '{"a": NaN}'}))  # fmt: skip
    for name, tracker in [("a word", "seven"), ("2^70", HUGE_INT), ("empty", "")]:
        add(
            Case(
                f"pretrain --load tracker {name}",
                [*PRETRAIN, *DYNAPIPE, *synthetic, "--load", "{d}/ck"],
                files={"ck/latest_checkpointed_iteration.txt": tracker},
            )
        )
    add(Case("pretrain --save /dev/null", [*PRETRAIN, *DYNAPIPE, *synthetic, "--save",
                                           "/dev/null"]))  # fmt: skip
    add(Case("pretrain --save a file", [*PRETRAIN, *DYNAPIPE, *synthetic, "--save", "{d}/f"],
             files={"f": "keep me"}))  # fmt: skip
    add(Case("pretrain --data-path a fifo", [*PRETRAIN, *DYNAPIPE, "--data-path", "{d}/f.jsonl"],
             setup=_fifo("f.jsonl")))  # fmt: skip
    add(Case("pretrain --data-path /dev/zero", [*PRETRAIN, *DYNAPIPE, "--data-path",
                                                "/dev/zero"]))  # fmt: skip
    for precision in ("--bf16", "--fp16"):
        add(Case(f"pretrain {precision} save, Megatron's loop", [
            *PRETRAIN, "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", precision, "--save",
            "{d}/ck", "--save-interval", "1"], 0))  # fmt: skip
    # tools/preprocess_data.py
    prefix = ["--output-prefix", "{d}/out"]
    for name, content in [("text 12345", _jsonl({"text": 12345})), ("deep", DEEP + "\n"),
                          ("invalid utf-8", b"\xff\xfe\n"), ("no text key", _jsonl({"t": "a"})),
                          ("not json", "hello\n")]:  # fmt: skip
        add(Case(f"preprocess {name}", [*PREPROCESS, "--input", "{d}/in.jsonl", *prefix],
                 files={"in.jsonl": content}))  # fmt: skip
    add(Case("preprocess /dev/zero", [*PREPROCESS, "--input", "/dev/zero", *prefix]))
    add(Case("preprocess a directory", [*PREPROCESS, "--input", "{d}", *prefix]))
    add(Case("preprocess missing", [*PREPROCESS, "--input", "{d}/none.jsonl", *prefix]))
    good = {"in.jsonl": _jsonl({"text": "hello world"})}
    add(Case("preprocess output .bin a fifo", [*PREPROCESS, "--input", "{d}/in.jsonl", *prefix],
             files=good, setup=_fifo("out_text_document.bin")))  # fmt: skip
    add(Case("preprocess output .idx a directory", [*PREPROCESS, "--input", "{d}/in.jsonl",
             *prefix], files={**good, "out_text_document.idx/x": ""}))  # fmt: skip
    add(Case("preprocess output in a new dir", [*PREPROCESS, "--input", "{d}/in.jsonl",
             "--output-prefix", "{d}/new/out"], 0, files=good))  # fmt: skip
    for flag, value in [
        ("--workers", "0"),
        ("--workers", str(2**63)),
        ("--tokenizer-type", "X"),
        ("--vocab-size", "-1"),
        ("--json-keys", ""),
    ]:
        given = [*PREPROCESS, "--input", "{d}/in.jsonl", *prefix, flag, value]
        add(Case(f"preprocess {flag} {value[:12]}", given, files=good))
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


def _devices_intact() -> bool:
    return all(stat.S_ISCHR(os.stat(dev).st_mode) for dev in DEVICES)


def _watch(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """Wait for `proc`; "hang" or "memory" when it had to be killed."""
    deadline = time.monotonic() + timeout_s
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in tree if p.is_running())
        except psutil.Error:
            rss = 0
        if rss > MEMORY_CAP or time.monotonic() > deadline:
            for p in [*root.children(recursive=True), root]:
                p.kill()
            proc.wait()
            return "memory" if rss > MEMORY_CAP else "hang"
        time.sleep(0.1)
    return None


def run_case(case: Case, timeout_s: float) -> tuple[str, str]:
    """(outcome, the last stderr line): "ok", "traceback", "crash", "hang", "memory",
    "silent", "replaced a device" or "other"."""
    with tempfile.TemporaryDirectory() as scratch:
        d = Path(scratch)
        for name, content in case.files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                (d / name).write_bytes(content)
            else:
                (d / name).write_text(content)
        if case.setup is not None:
            case.setup(d)
        argv = [a.replace("{d}", scratch) for a in case.argv]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29655"}  # fmt: skip
        with (d / ".stderr").open("w+") as err:
            proc = subprocess.Popen(argv, cwd=scratch, env=env, stdout=subprocess.DEVNULL,
                                    stderr=err, stdin=subprocess.DEVNULL)  # fmt: skip
            killed = _watch(proc, timeout_s)
            err.seek(0)
            stderr = err.read()
        kept = [name for name in case.files if _text(d / name) == "keep me"]
        lost = [name for name, c in case.files.items() if c == "keep me" and name not in kept]
    lines = stderr.strip().splitlines() or [""]
    last = lines[-1][:240]
    errors = [line for line in lines if ": error:" in line]
    if not _devices_intact():
        return "replaced a device", last
    if killed:
        return killed, last
    if "Traceback (most recent call last)" in stderr:
        return "traceback", last
    if proc.returncode < 0:
        return "crash", f"signal {-proc.returncode}; {last}"
    if lost:
        return "other", f"overwrote {lost}"
    if proc.returncode == case.expect and (case.expect == 0 or len(errors) == 1):
        return "ok", errors[0][:240] if errors else last
    if proc.returncode == 0:
        return "silent", last
    return "other", f"exit {proc.returncode}, {len(errors)} error lines; {last}"


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name holds this")
    parser.add_argument("--timeout", type=float, default=180.0, help="per case (s)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if not _devices_intact():
        parser.error(f"one of {DEVICES} is not a device node on this machine; restore it first")
    selected = [c for c in cases() if args.only in c.name]
    counts: Counter[tuple[str, str]] = Counter()
    for case in selected:
        outcome, line = run_case(case, args.timeout)
        program = case.name.split()[0]
        counts[program, outcome] += 1
        if outcome != "ok" or args.verbose:
            print(f"{outcome:>10} | {case.name} | {line}", flush=True)
        if outcome == "replaced a device":
            print("a device node was replaced: stopping (restore it with mknod)", flush=True)
            break
    programs = sorted({p for p, _ in counts})
    outcomes = sorted({o for _, o in counts})
    print(f"\n{len(selected)} cases")
    print(f"{'':>10} " + " ".join(f"{o:>10}" for o in outcomes))
    for p in programs:
        print(f"{p:>10} " + " ".join(f"{counts[p, o]:>10}" for o in outcomes))
    return 0 if set(outcomes) <= {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
