"""`input_files.load_json_file`, the one reader of users' JSON files (#36): every way a file can
be wrong is one line naming the reader's item (its flag or role) and the path, raised as the
caller's error type without a chained cause, and a CLI reports it as that line, no traceback."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dynapipe_planner.cli import plan_main
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.input_files import MAX_INPUT_BYTES, load_json_file


def _write(text: str | bytes) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / "input.json"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return path

    return make


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def _too_large(tmp: Path) -> Path:
    path = tmp / "huge.json"
    with path.open("wb") as f:
        f.truncate(MAX_INPUT_BYTES + 1)  # sparse: nothing is written or read
    return path


NOT_JSON = "{item} {path}: not valid JSON"
# How each bad file is made, and the line (the reader's item and the path filled in).
CASES = {
    "missing": (lambda tmp: tmp / "no.json", "cannot read {item} {path}: the file does not exist"),
    "directory": (lambda tmp: tmp, "{item} {path}: not a regular file"),
    "fifo": (_fifo, "{item} {path}: not a regular file"),
    "too large": (
        _too_large,
        f"{{item}} {{path}}: {MAX_INPUT_BYTES + 1:,} bytes, more than the {MAX_INPUT_BYTES:,} read",
    ),
    "invalid": (
        _write('{\n  "layers": 4,\n}\n'),
        NOT_JSON + " (Expecting property name enclosed in double quotes at line 3 column 1)",
    ),
    "truncated": (_write('{"a": ['), NOT_JSON + " (Expecting value at line 1 column 8)"),
    "not utf-8": (
        _write(b'{"a": "\xff"}'),
        "{item} {path}: not UTF-8 text (invalid start byte at byte 7)",
    ),
    "nan": (_write('{"a": NaN}'), NOT_JSON + " (NaN is not a number JSON allows)"),
    "int64": (
        _write('{"a": ' + "9" * 30 + "}"),
        NOT_JSON + " (integer 999999999999999999999999... does not fit int64)",
    ),
    "nested": (_write("[" * 100_000 + "]" * 100_000), NOT_JSON + " (nested too deeply)"),
    "array": (_write("[1, 2]"), "{item} {path}: its top level is an array, not an object"),
    "null": (_write("null"), "{item} {path}: its top level is null, not an object"),
    "boolean": (_write("true"), "{item} {path}: its top level is a boolean, not an object"),
}


class FlagError(ValueError):
    """A caller's own error type, as the runtime's readers pass theirs."""


@pytest.mark.parametrize("case", list(CASES))
def test_each_error_is_one_line_naming_the_item_and_path(tmp_path: Path, case: str) -> None:
    make, line = CASES[case]
    path = make(tmp_path)
    with pytest.raises(FlagError) as caught:
        load_json_file(path, "--some-flag", FlagError)
    assert str(caught.value) == line.format(item="--some-flag", path=path)
    error = caught.value  # no chained error: a traceback, if asked for, is one frame deep
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_an_unreadable_file_gives_the_system_reason(tmp_path: Path, monkeypatch) -> None:
    path = _write("{}")(tmp_path)

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(PlanningError) as caught:
        load_json_file(path, "cost table")
    assert str(caught.value) == f"cannot read cost table {path}: Permission denied"


def test_a_good_file_and_the_caller_s_choice_of_top_level(tmp_path: Path) -> None:
    path = _write('{"a": [1, 2.5, "x", null, true]}')(tmp_path)
    assert load_json_file(path, "plan") == {"a": [1, 2.5, "x", None, True]}
    path.write_text("[1, 2]")
    assert load_json_file(path, "plan", kind=list) == [1, 2]
    assert load_json_file(path, "plan", kind=None) == [1, 2]  # the caller names what it expected
    with pytest.raises(PlanningError, match="its top level is an array, not a string"):
        load_json_file(path, "plan", kind=str)


@pytest.mark.parametrize("case", [c for c in CASES if c != "missing"])
def test_a_cli_prints_the_line_and_no_traceback(tmp_path: Path, case: str) -> None:
    """`dynapipe-plan --model FILE` reads its model spec with the helper: exit status 2, and
    stderr is the one line, after the program's name (a missing file it names as neither a
    preset nor a file, before reading)."""
    make, line = CASES[case]
    path = make(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_main(["--model", str(path), "--preset", "flan", "--num-samples", "10"])
    assert code == 2
    expected = line.format(item="model spec", path=path)
    assert err.getvalue() == f"dynapipe-plan: error: {expected}\n"
    assert "Traceback" not in out.getvalue()
