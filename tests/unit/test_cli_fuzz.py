"""Fuzzing the planner CLIs with bad input (#18): each is answered with exit status 2 and one
line `<prog>: error: ...` on stderr, no traceback, and no output file or directory created."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from paths import ROOT

from dynapipe_planner.cli import plan_main, simulate_main
from dynapipe_planner.hetero.cli import hetero_main
from dynapipe_planner.hetero.layer_assign import assign_micro_batches
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search.cli import search_main
from dynapipe_planner.strategy.cli import strategy_main

CLUSTER = str(ROOT / "examples" / "clusters" / "mixed_8gpu.yaml")
FUZZ = settings(
    max_examples=examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# Fast valid invocations; each test swaps one item for a bad one.
BASE = {
    "dynapipe-plan": (plan_main, ["--model", "gpt-350m", "--gpu", "A100-40GB",
                                  "--pipeline-model-parallel-size", "2", "--preset", "flan",
                                  "--num-samples", "200", "--seq-length", "1024",
                                  "--tokens-per-global-batch", "8192", "--batching", "dynamic"]),
    "dynapipe-search": (search_main, ["--model", "gpt-350m", "--num-gpus", "4",
                                      "--memory-limit-gib", "20", "--global-batch-size", "8",
                                      "--quiet"]),
    "dynapipe-hetero": (hetero_main, ["--cluster", CLUSTER, "--model", "gpt-350m",
                                      "--global-batch-size", "8", "--seq-length", "1024",
                                      "--max-plans", "40", "--quiet"]),
    "dynapipe-strategy": (strategy_main, ["propose", "--preset", "webcode", "--num-samples",
                                          "500", "--num-gpus", "8", "--model", "gpt-350m"]),
}  # fmt: skip

# (prog, flag, kind): "pos" must be > 0, "nonneg" >= 0; "int"/"float" the type it parses as.
NUMERIC = [
    *(("dynapipe-plan", f, "pos int") for f in ("--num-samples", "--tokens-per-global-batch",
      "--iterations", "--pipeline-model-parallel-size", "--num-gpus",
      "--tensor-model-parallel-size", "--gpus-per-node")),
    *(("dynapipe-plan", f, "nonneg int") for f in ("--seq-length", "--micro-batch-size",
      "--seed")),
    ("dynapipe-plan", "--memory-limit-gib", "nonneg float"),
    *(("dynapipe-search", f, "pos int") for f in ("--num-gpus", "--gpus-per-node",
      "--seq-length", "--decoder-seq-length", "--global-batch-size", "--max-batch-size",
      "--pipeline-model-parallel-size", "--max-tp", "--memory-bins")),
    ("dynapipe-search", "--overlap-slowdown", "pos float"),
    ("dynapipe-search", "--memory-limit-gib", "nonneg float"),
    *(("dynapipe-hetero", f, "pos int") for f in ("--seq-length", "--global-batch-size",
      "--micro-batch-size", "--tau", "--max-plans")),
    *(("dynapipe-hetero", f, "nonneg int") for f in ("--max-dp", "--seed")),
    *(("dynapipe-strategy", f, "pos int") for f in ("--num-samples", "--seq-length",
      "--tokens-per-global-batch", "--length-step", "--num-gpus", "--gpus-per-node", "--max-tp",
      "--keep")),
    *(("dynapipe-strategy", f, "nonneg int") for f in ("--seed",)),
    ("dynapipe-strategy", "--memory-limit-gib", "nonneg float"),
]  # fmt: skip


def run(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_refused(prog: str, main, argv: list[str], *, not_created: Path | None = None) -> str:
    code, out, err = run(main, argv)
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (argv, code, err)
    assert len(lines) == 1, (argv, err)
    assert lines[0].startswith(f"{prog}") and ": error: " in lines[0], lines[0]
    if not_created is not None:
        assert not not_created.exists() or (not_created.is_dir() and not any(not_created.iterdir()))
    return lines[0]


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag, value]


def bad_numbers(kind: str) -> st.SearchStrategy[str]:
    sign, typ = kind.split()
    words = st.text(alphabet="abcxyz-_.,", min_size=1, max_size=6).filter(_not_a_number)
    bad = [
        st.sampled_from(["nan", "NaN", "inf", "-inf", "-1"]),
        st.integers(min_value=2**63, max_value=2**80).map(str),
        st.integers(max_value=-1, min_value=-(2**70)).map(str),
        words,
    ]
    if sign == "pos":
        bad.append(st.just("0"))
    if typ == "int":
        bad.append(st.sampled_from(["1.5", "1e20", "0x10"]))
    return st.one_of(bad)


def _not_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


@FUZZ
@given(case=st.sampled_from(NUMERIC), data=st.data())
def test_bad_numeric_flags(case, data):
    prog, flag, kind = case
    value = data.draw(bad_numbers(kind))
    if flag == "--seed" and value.lstrip("-").isdigit() and 0 <= int(value) < 2**32:
        return
    main, argv = BASE[prog]
    assert_refused(prog, main, with_flag(argv, flag, value))


@pytest.mark.parametrize("value", ["-1", "0"])
@pytest.mark.parametrize("flag", ["--iterations", "--trials"])
def test_strategy_plan_counts(flag, value):
    argv = ["plan", *BASE["dynapipe-strategy"][1][1:], flag, value]
    assert_refused("dynapipe-strategy", strategy_main, argv)


@pytest.mark.parametrize(
    ("prog", "flag", "value"),
    [
        ("dynapipe-plan", "--num-samples", str(2**62)),  # numpy: "array is too big"
        ("dynapipe-strategy", "--num-samples", "100000001"),
        ("dynapipe-strategy", "--num-gpus", str(2**62)),  # was planned for, exit 0
        ("dynapipe-search", "--num-gpus", "16385"),
        ("dynapipe-plan", "--memory-limit-gib", str(2**21)),
        ("dynapipe-search", "--memory-limit-gib", "1e300"),
    ],
)
def test_counts_past_their_bound(prog, flag, value):
    main, argv = BASE[prog]
    line = assert_refused(prog, main, with_flag(argv, flag, value))
    assert flag in line


LENGTH_FILES = st.one_of(
    st.just(b""),
    st.just(b"\n\n"),
    st.lists(st.integers(max_value=0, min_value=-(10**6)), min_size=1, max_size=5).map(
        lambda xs: "\n".join(map(str, [10, *xs])).encode()
    ),
    st.floats(min_value=0.01, max_value=1e6)
    .filter(lambda x: x != int(x))
    .map(lambda x: f"10\n{x}\n".encode()),
    st.integers(min_value=2**63, max_value=2**80).map(lambda x: f"10\n{x}\n".encode()),
    st.sampled_from([b"nan\n", b"inf\n", b"abc\n", b"10 20\n", b"1e3\n"]),
    st.binary(min_size=1, max_size=64).filter(lambda b: not b.strip().isdigit()),
)


@FUZZ
@given(content=LENGTH_FILES, prog=st.sampled_from(["dynapipe-plan", "dynapipe-strategy"]))
def test_bad_length_files(content, prog):
    main, argv = BASE[prog]
    argv = [a for a in argv if a not in ("--preset", "flan", "webcode")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lengths.txt"
        path.write_bytes(content)
        assert_refused(prog, main, [*argv, "--lengths", str(path)])


GOOD_MODEL = dataclasses.asdict(MODEL_PRESETS["gpt-350m"])
REQUIRED = ["arch", "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"]
BAD_VALUES = [math.nan, math.inf, -1, 2**70, "x", None, [], {}, 1.5]


def _mutated_model() -> st.SearchStrategy[str]:
    missing = st.sampled_from(REQUIRED).map(
        lambda k: json.dumps({f: v for f, v in GOOD_MODEL.items() if f != k})
    )
    bad = st.tuples(
        st.sampled_from([f for f in GOOD_MODEL if f != "name"]),
        st.sampled_from(BAD_VALUES),
    ).map(lambda kv: json.dumps({**GOOD_MODEL, kv[0]: kv[1]}))
    other = st.sampled_from(
        ["", "[]", "{}", "null", json.dumps(GOOD_MODEL)[:40], '{"hidden_size": NaN}']
    )
    return st.one_of(missing, bad, other)


@FUZZ
@given(text=_mutated_model(), prog=st.sampled_from(sorted(BASE)))
def test_bad_model_json(text, prog):
    main, argv = BASE[prog]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.json"
        path.write_text(text)
        assert_refused(prog, main, with_flag(argv, "--model", str(path)))


MACHINE = {"name": "a", "gpu": "A100-80GB", "count": 4}
CLUSTERS = st.one_of(
    st.binary(min_size=0, max_size=64),
    st.sampled_from([":: [ {", "", "- 1\n- 2\n", "name: x\n", "name: x\nmachines: 5\n"]),
    st.tuples(  # a machine's name is free-form and optional
        st.sampled_from(["gpu", "count"]),
        st.sampled_from([None, -1, 0, 100000000, 2**70, "four", math.nan, [], "Z80"]),
    ).map(lambda kv: json.dumps({"name": "x", "machines": [{**MACHINE, kv[0]: kv[1]}]})),
    st.sampled_from(["gpu", "count"]).map(
        lambda k: json.dumps(
            {"name": "x", "machines": [{f: v for f, v in MACHINE.items() if f != k}]}
        )
    ),
)


@FUZZ
@given(content=CLUSTERS)
def test_bad_cluster_yaml(content):
    main, argv = BASE["dynapipe-hetero"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        if isinstance(content, bytes):
            try:  # random bytes that happen to be a valid cluster are not bad input
                import yaml

                data = yaml.safe_load(content)
                if isinstance(data, dict) and "machines" in data:
                    return
            except (yaml.YAMLError, UnicodeDecodeError):
                pass
        assert_refused("dynapipe-hetero", main, with_flag(argv, "--cluster", str(path)))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plans")
    code, _, err = run(plan_main, [*BASE["dynapipe-plan"][1], "--output-dir", str(out)])
    assert code == 0, err
    return out / "iter_00000.json"


WRONG = [None, "x", -1, 2**70, [], {"a": 1}, 1.5, [1, 2]]


@FUZZ
@given(data=st.data())
def test_bad_plan_json(plan_file, data):
    text = plan_file.read_text()
    plan = json.loads(text)
    choice = data.draw(st.sampled_from(["truncate", "top", "microbatch"]))
    if choice == "truncate":
        cut = data.draw(st.integers(min_value=0, max_value=len(text.rstrip()) - 1))
        bad = text[:cut]
    elif choice == "top":
        key = data.draw(st.sampled_from(["num_stages", "num_replicas", "microbatches",
                                         "ranks", "meta", "stats", "version"]))  # fmt: skip
        value = data.draw(st.sampled_from(WRONG).filter(lambda v: (key, v) != ("stats", {"a": 1})))
        bad = json.dumps({**plan, key: value})
    else:
        key = data.draw(st.sampled_from(sorted(plan["microbatches"][0])))
        values = st.sampled_from(["x", None, -1, 2**70, []])
        # no row_sizes is a valid micro-batch (one sample per row) when nothing says otherwise
        plan["microbatches"][0][key] = data.draw(
            values.filter(lambda v: (key, v) != ("row_sizes", []))
        )
        bad = json.dumps(plan)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(bad)
        trace = Path(tmp) / "trace.json"
        assert_refused(
            "dynapipe-simulate", simulate_main, [str(path), "--trace", str(trace)],
            not_created=trace,
        )  # fmt: skip


OUTPUT_FLAGS = [
    ("dynapipe-plan", "--output-dir", None),
    ("dynapipe-search", "--output", None),
    ("dynapipe-hetero", "--output", None),
    ("dynapipe-strategy", "--output", None),
    ("dynapipe-simulate", "--trace", None),
    ("dynapipe-simulate", "--png", None),
]


@pytest.mark.parametrize("where", ["directory", "missing-parent", "file-parent", "read-only"])
@pytest.mark.parametrize(("prog", "flag", "_"), OUTPUT_FLAGS)
def test_bad_output_paths(tmp_path, plan_file, prog, flag, _, where):
    if prog == "dynapipe-simulate":
        main, argv = simulate_main, [str(plan_file)]
    else:
        main, argv = BASE[prog]
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    target = {
        "directory": tmp_path / "adir",
        "missing-parent": tmp_path / "nope" / "sub" / "out.json",
        "file-parent": tmp_path / "afile" / "out.json",
        "read-only": tmp_path / "ro" / "out.json",
    }[where]
    if where == "directory" and flag == "--output-dir":
        target = tmp_path / "afile"  # a directory is what --output-dir wants; a file is not
    if where == "read-only":
        (tmp_path / "ro").mkdir(mode=0o500)
        if os.access(tmp_path / "ro", os.W_OK):
            pytest.skip("running as root: permissions do not stop writes")
    assert_refused(prog, main, [*argv, flag, str(target)])
    assert (tmp_path / "afile").read_text() == "x"
    assert not any((tmp_path / "adir").iterdir())
    assert not (tmp_path / "nope").exists()


DEBUG_CASES = [
    *(pytest.param(prog, main, argv, "--model", id=prog) for prog, (main, argv) in BASE.items()),
    pytest.param("dynapipe-simulate", simulate_main, [], "plan", id="dynapipe-simulate"),
]


@pytest.mark.parametrize("asked", ["quiet", "--debug", "DYNAPIPE_DEBUG"])
@pytest.mark.parametrize(("prog", "main", "argv", "bad_item"), DEBUG_CASES)
def test_debug_adds_the_traceback_of_an_error(tmp_path, monkeypatch, prog, main, argv, bad_item,
                                              asked):  # fmt: skip
    """A file the planner refuses (here a model or plan without fields) is one line; `--debug`
    or DYNAPIPE_DEBUG=1 prints the traceback before that line, and the exit status stays 2."""
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    argv = [str(bad)] if bad_item == "plan" else with_flag(argv, bad_item, str(bad))
    monkeypatch.setenv("DYNAPIPE_DEBUG", "1" if asked == "DYNAPIPE_DEBUG" else "0")
    if asked == "--debug":
        argv = [*argv, "--debug"]
    code, _, err = run(main, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert lines[-1].startswith(f"{prog}: error: "), lines[-1]
    if asked == "quiet":
        assert len(lines) == 1, err
    else:
        assert lines[0] == "Traceback (most recent call last):" and len(lines) > 2, err


def test_debug_before_a_subcommand(tmp_path):
    """`dynapipe-strategy --debug propose ...`: the subcommand's parser leaves the flag set."""
    main, argv = BASE["dynapipe-strategy"]
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run(main, ["--debug", *with_flag(argv, "--model", str(tmp_path / "bad.json"))])
    assert code == 2 and "Traceback (most recent call last):" in err, err


def test_huge_global_batch_ends_within_budget():
    """`--global-batch-size 1e20` (as an integer) once looped past the time budget."""
    main, argv = BASE["dynapipe-hetero"]
    started = time.perf_counter()
    flag = "--global-batch-size"
    assert_refused("dynapipe-hetero", main, with_flag(argv, flag, str(10**20)))
    assert_refused("dynapipe-hetero", main, with_flag(argv, flag, str(10**15)))
    assert time.perf_counter() - started < 5


def test_largest_allowed_global_batch_plans_within_budget():
    main, argv = BASE["dynapipe-hetero"]
    started = time.perf_counter()
    code, _, err = run(main, with_flag(argv, "--global-batch-size", "100000"))
    assert code == 0, err
    assert time.perf_counter() - started < 15


def test_micro_batch_assignment_takes_no_step_per_micro_batch():
    started = time.perf_counter()
    assert assign_micro_batches([(0.1, 0.3), (0.2, 0.7)], 10**15) == [7 * 10**14, 3 * 10**14]
    assert time.perf_counter() - started < 1


@settings(max_examples=examples(200), deadline=None)
@given(
    profiles=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=5),
            st.sampled_from([1e-3, 0.25, 0.5, 1.0, 0.3, 0.7]) | st.floats(0.001, 3),
        ),
        min_size=1,
        max_size=6,
    ),
    total=st.integers(min_value=0, max_value=300),
)
def test_micro_batch_assignment_equals_the_greedy_steps(profiles, total):
    """The shortcut gives exactly what one greedy step per micro-batch gives."""
    import heapq

    k = len(profiles)
    expected = None
    if total >= k:
        expected = [1] * k
        heap = [(f + b, i) for i, (f, b) in enumerate(profiles)]
        heapq.heapify(heap)
        for _ in range(total - k):
            _, i = heapq.heappop(heap)
            expected[i] += 1
            heapq.heappush(heap, (profiles[i][0] + expected[i] * profiles[i][1], i))
    assert assign_micro_batches(profiles, total) == expected


@pytest.mark.parametrize("prog", ["dynapipe-search", "dynapipe-hetero", "dynapipe-strategy"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_output_that_is_not_a_regular_file_is_refused_and_kept(prog, kind, tmp_path):
    """Issue 34: the writers replace their target through a renamed temporary file, which would
    turn a device, FIFO or directory into a regular file; they name it instead, and it stays."""
    target = tmp_path / kind
    os.mkfifo(target) if kind == "fifo" else target.mkdir()
    main, argv = BASE[prog]
    line = assert_refused(prog, main, [*argv, "--output", str(target)])
    why = "is not a regular file" if kind == "fifo" else "is a directory"
    assert f"--output: {target} {why}" in line, line
    assert target.is_fifo() if kind == "fifo" else target.is_dir()


def test_a_timeline_image_over_a_fifo_is_refused_and_kept(tmp_path):
    plans = tmp_path / "plans"
    main, argv = BASE["dynapipe-plan"]
    assert run(main, [*argv, "--iterations", "1", "--output-dir", str(plans)])[0] == 0
    target = tmp_path / "fifo"
    os.mkfifo(target)
    plan = str(next(plans.iterdir()))
    line = assert_refused("dynapipe-simulate", simulate_main, [plan, "--png", str(target)])
    assert f"{target} is not a regular file" in line and target.is_fifo(), line


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# Issue 34: inputs that crashed a reader, exhausted memory or were taken silently. Each is one
# line, exit status 2 (`where` is a file written per case, or a path as it is).
BAD_INPUTS = [
    ("dynapipe-simulate", None, "/dev/zero", "plan /dev/zero: not a regular file"),
    ("dynapipe-hetero", "--cluster", "/dev/zero", "cluster file /dev/zero: not a regular file"),
    ("dynapipe-plan", "--lengths", "/dev/zero", "lengths file /dev/zero: not a regular file"),
    ("dynapipe-search", "--model", "/dev/zero", "model spec /dev/zero: not a regular file"),
    ("dynapipe-plan", "--lengths", b"9" * 5000 + b"\n", "is not an integer length"),
    ("dynapipe-plan", "--lengths", b'{"text": 12345}\n', "field 'text' is '12345'; expected"),
    ("dynapipe-plan", "--model", _deep(100_000).encode(), "not valid JSON (nested too deeply)"),
    ("dynapipe-plan", "--model", b'{"num_layers": ' + b"7" * 5000 + b"}", "does not fit int64"),
    ("dynapipe-hetero", "--cluster", _deep(100_000).encode(), "nested too deeply"),
    ("dynapipe-simulate", None, _deep(100_000).encode(), "nested too deeply"),
    ("dynapipe-simulate", None, b'{"version": 1e999}', "is not finite"),
]


def _npy_declaring(elements: int) -> bytes:
    header = f"{{'descr': '<i8', 'fortran_order': False, 'shape': ({elements},), }}"
    header += " " * (118 - len(header)) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\0" * 64


@pytest.mark.parametrize(("prog", "flag", "given", "named"), BAD_INPUTS)
def test_inputs_that_crashed_or_exhausted_a_reader_are_one_line(
    tmp_path, prog, flag, given, named
) -> None:
    main = simulate_main if prog == "dynapipe-simulate" else BASE[prog][0]
    argv = [] if prog == "dynapipe-simulate" else list(BASE[prog][1])
    if prog == "dynapipe-plan" and flag == "--lengths":
        argv = [a for a in argv if a not in ("--preset", "flan")]
    path = given
    if isinstance(given, bytes):
        path = str(tmp_path / ("lengths.jsonl" if b"text" in given else "input.json"))
        Path(path).write_bytes(given)
    argv = [*argv, path] if flag is None else with_flag(argv, flag, path)
    assert named in assert_refused(prog, main, argv)


def test_an_npy_header_larger_than_its_file_is_refused_before_allocating(tmp_path) -> None:
    path = tmp_path / "lengths.npy"
    path.write_bytes(_npy_declaring(10**13))
    main, argv = BASE["dynapipe-plan"]
    argv = [a for a in argv if a not in ("--preset", "flan")]
    line = assert_refused("dynapipe-plan", main, [*argv, "--lengths", str(path)])
    assert "its header declares shape (10000000000000,) of int64" in line


def test_an_absurd_sequence_length_never_reaches_the_cpp_core_wrapped() -> None:
    """--seq-length 10^15 priced memory past int64 and crashed the C++ layer DP (SIGSEGV); it
    is refused at parse time now, and the longest length allowed is priced without wrapping."""
    main, argv = BASE["dynapipe-search"]
    line = assert_refused("dynapipe-search", main, with_flag(argv, "--seq-length", str(10**15)))
    assert "is more than 16777216 tokens in one sequence" in line
    line = assert_refused("dynapipe-search", main, with_flag(argv, "--seq-length", str(2**24)))
    assert "does not fit in 20.00 GiB per GPU" in line


def test_an_error_line_is_one_write(monkeypatch) -> None:
    """Ranks that fail together share one stderr; written in two parts (the text, then the
    newline) on an unbuffered stream, their lines ran into one another."""
    from dynapipe_planner.cli_args import report_error

    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr("sys.stderr", Stream())
    report_error("pretrain_gpt.py", OSError("disk full\nmore detail"), None)
    assert writes == ["pretrain_gpt.py: error: disk full\n"]
