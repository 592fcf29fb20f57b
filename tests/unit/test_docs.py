"""The documentation a newcomer reads: README.md short, every docs/ file linked from it, every
repository path and module the docs name present, CI running the README's test command, and
CHANGELOG entries of one or two lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from paths import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
CHANGELOG = ROOT / "CHANGELOG.md"
MAX_ENTRY_CHARS = 220  # two lines of a wide editor; details live in docs/

# Backticked repository paths (`dynapipe_planner/plan.py`, `tools/profile_costs.py --clock cpu`)
# and dotted module names (`megatron.dynapipe.megatron_loop`, `dynapipe_planner.search.search`,
# `benchmarks.throughput`).
PATH_ROOTS = (
    "dynapipe_planner",
    "megatron/dynapipe",
    "benchmarks",
    "examples",
    "tools",
    "tests",
    "csrc",
    "docs",
)
PATH = re.compile(r"(?<![\w./-])(?:" + "|".join(map(re.escape, PATH_ROOTS)) + r")/[\w./*<>-]*")
MODULE = re.compile(
    r"(?<![\w.])(?:dynapipe_planner|megatron\.dynapipe)(?:\.\w+)*"
    # the repository's own packages, run from its root (`python -m benchmarks.cpu_throughput`)
    r"|(?<![\w./-])(?:benchmarks|examples)(?:\.\w+)+"
)
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Compiled extensions (setup.py) have no source file of their own name.
EXTENSIONS = {"dynapipe_planner._core", "megatron.dynapipe._bus_error"}


def _docs() -> list[Path]:
    return [README, *DOCS]


def _code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    spans = CODE.findall(text)
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        spans.extend(block.splitlines())
    return spans


def _paths(text: str) -> set[str]:
    found = set()
    for span in _code_spans(text):
        for path in PATH.findall(span):
            path = path.rstrip(".,:;")
            # Wildcards, placeholders and what running a command creates are not repository files.
            if any(c in path for c in "*<>") or path.startswith("examples/out"):
                continue
            found.add(path.rstrip("/"))
    return found


def _modules(text: str) -> set[str]:
    return {m for span in CODE.findall(text) for m in MODULE.findall(span)}


def _module_exists(name: str) -> bool:
    """A dotted name resolves when its longest module prefix is a package or a file, and the
    first name after it (if any) is a compiled extension or appears in that module's source."""
    parts = name.split(".")
    base, source, i = ROOT, "", 0
    while i < len(parts):
        module, package = base / f"{parts[i]}.py", base / parts[i]
        if module.is_file():
            source, i = module.read_text(), i + 1
            break
        if not package.is_dir():
            break
        init = package / "__init__.py"
        base, source, i = package, init.read_text() if init.exists() else "", i + 1
    if i < (2 if parts[0] == "megatron" else 1):
        return False
    if i == len(parts) or ".".join(parts[: i + 1]) in EXTENSIONS:
        return True
    return re.search(rf"\b{re.escape(parts[i])}\b", source) is not None


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, at most {MAX_README_LINES}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_named_paths_exist(doc: Path):
    missing = sorted(p for p in _paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_named_modules_exist(doc: Path):
    missing = sorted(m for m in _modules(doc.read_text()) if not _module_exists(m))
    assert not missing, f"{doc.name} names modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_links_resolve(doc: Path):
    targets = [t for t in LINK.findall(doc.read_text()) if "://" not in t]
    missing = sorted(t for t in targets if not (doc.parent / t).exists())
    assert not missing, f"{doc.name} links to files that do not exist: {missing}"


def test_every_doc_is_linked_from_readme():
    linked = {
        (ROOT / t).resolve() for t in LINK.findall(README.read_text()) if t.startswith("docs/")
    }
    assert {d.resolve() for d in DOCS} <= linked, "docs/ files not linked from README.md"
    assert all(p.exists() for p in linked)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if "pytest" in line and not line.startswith("#")]
    assert len(commands) == 1, ".ci/run should hold one test command"
    assert commands[0] in README.read_text().splitlines()


def test_changelog_entries_are_one_or_two_lines():
    entries = [line for line in CHANGELOG.read_text().splitlines() if line.startswith("- ")]
    long = [entry[:60] for entry in entries if len(entry) > MAX_ENTRY_CHARS]
    assert entries and not long, f"CHANGELOG entries over {MAX_ENTRY_CHARS} characters: {long}"
