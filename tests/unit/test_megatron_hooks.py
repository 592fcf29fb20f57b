"""The runtime's replacements inside megatron-core, megatron.training and torch are the ones
`megatron/dynapipe/megatron_hooks.py` declares (GitHub issue #36), and they still fit.

- every declared target (`HOOKS`, `SWAPS`, `STATE`) still exists where the table says, a
  function with the parameters the table recorded: a megatron-core upgrade that moves or
  changes one fails here, naming it, instead of leaving a patch dead or a wrapper wrong;
- every entry was tested with the installed megatron-core (torch) version;
- no runtime module but `megatron_hooks` assigns into a megatron or torch module (an `ast`
  scan: attributes of names bound to such modules, `setattr`/`delattr` on them, `sys.modules`
  edits); the scanner is shown catching each form first;
- `install()` changes exactly the attributes `HOOKS` lists, each to its replacement, keeps
  what was there for `original`, and changes nothing the second time.

Single process, no subprocess: the test process does not import `megatron.dynapipe.enable`
(`tests/conftest.py`), so `install()` runs here and every attribute it sets is put back.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import types
from typing import Any

import pytest
from paths import ROOT

pytest.importorskip("megatron.training")

import torch

from megatron.dynapipe import megatron_hooks
from megatron.dynapipe.megatron_hooks import HOOKS, STATE, SWAPS, Hook

RUNTIME = ROOT / "megatron" / "dynapipe"
HOOKS_MODULE = RUNTIME / "megatron_hooks.py"
# Modules the runtime must not assign into except through `megatron_hooks`.
WATCHED = ("megatron", "torch")
OWN = "megatron.dynapipe"


def _pristine(entry: Hook | megatron_hooks.Swap) -> Any:
    """What `entry`'s target holds without DynaPipe: its original where the hook is in place."""
    owner, name = megatron_hooks._owner(entry.module, entry.attribute)
    current = getattr(owner, name)
    if isinstance(entry, Hook) and current is megatron_hooks.replacement(entry):
        return megatron_hooks.original(entry.target)
    return current


@pytest.mark.parametrize("entry", [*HOOKS, *SWAPS], ids=lambda entry: entry.target)
def test_every_target_exists_with_its_recorded_parameters(entry) -> None:
    try:
        found = _pristine(entry)
    except (ImportError, AttributeError) as missing:
        pytest.fail(f"{entry.target} (megatron_hooks) no longer exists: {missing}")
    if entry.parameters is None:
        assert isinstance(found, types.ModuleType), f"{entry.target} is no longer a module"
        return
    assert callable(found), f"{entry.target} (megatron_hooks) is no longer callable"
    parameters = tuple(inspect.signature(found).parameters)
    assert parameters == entry.parameters, (
        f"{entry.target} changed its parameters: megatron_hooks recorded {entry.parameters}, "
        f"the installed one takes {parameters}"
    )


@pytest.mark.parametrize("hook", HOOKS, ids=lambda hook: hook.target)
def test_every_replacement_exists(hook) -> None:
    found = megatron_hooks.replacement(hook)
    assert found is not None
    if hook.parameters is not None:
        assert callable(found), f"{hook.replacement} (for {hook.target}) is not callable"


@pytest.mark.parametrize("entry", [*SWAPS, *STATE], ids=lambda entry: entry.by)
def test_every_swap_and_global_names_the_function_that_sets_it(entry) -> None:
    module, name = entry.by.split(":")
    assert callable(getattr(importlib.import_module(f"megatron.dynapipe.{module}"), name, None))


@pytest.mark.parametrize("state", STATE, ids=lambda state: state.module)
def test_every_declared_global_exists(state) -> None:
    module = importlib.import_module(state.module)
    missing = [name for name in state.attributes if not hasattr(module, name)]
    assert not missing, f"{state.module} no longer has {missing} (megatron_hooks.STATE)"


def _installed_version(module: str) -> str:
    """The installed version of the package `module` belongs to: megatron-core's from its
    `package_info` (without the git suffix it adds in a checkout), torch's without its build."""
    if module.split(".")[0] == "torch":
        return torch.__version__.split("+")[0]
    package_info = importlib.import_module("megatron.core.package_info")
    return getattr(package_info, "__shortversion__", package_info.__version__.split("+")[0])


def test_every_entry_was_tested_with_the_installed_versions() -> None:
    untested = [
        f"{getattr(entry, 'target', entry.module)} (tested with {entry.tested_with}, "
        f"installed {_installed_version(entry.module)})"
        for entry in (*HOOKS, *SWAPS, *STATE)
        if _installed_version(entry.module) not in entry.tested_with
    ]
    assert not untested, "check these against the installed version: " + "; ".join(untested)


def test_the_table_is_well_formed() -> None:
    targets = [hook.target for hook in HOOKS]
    assert len(targets) == len(set(targets)), "a target is hooked twice"
    assert {hook.group for hook in HOOKS} == set(megatron_hooks.GROUPS)
    long = [entry for entry in (*HOOKS, *SWAPS, *STATE) if not 0 < len(entry.why) <= 90]
    assert not long, f"say why in one short line: {long}"


# The source scan.


def _watched(name: str) -> bool:
    outside = name != OWN and not name.startswith(OWN + ".")
    return outside and any(name == w or name.startswith(w + ".") for w in WATCHED)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the source binds (in any scope) to a watched module, or to an attribute reached
    from one (`cuda = torch.cuda`, `wrapped = torch_norm.WrappedTorchNorm`). One set per
    file: a parameter named like such a module (`def f(training)`) counts too."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _watched(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and _watched(node.module or ""):
            for alias in node.names:
                if _is_module(f"{node.module}.{alias.name}"):
                    names.add(alias.asname or alias.name)
    grown = True
    while grown:
        grown = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _root(node.value) in names:
                if not isinstance(node.value, ast.Attribute):
                    continue
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id not in names:
                        names.add(target.id)
                        grown = True
    return names


def _is_sys_modules(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "modules"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _assigned(node: ast.AST) -> list[ast.AST]:
    """The targets an assignment, augmented assignment or `del` statement writes."""
    if isinstance(node, ast.Assign | ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    flat: list[ast.AST] = []
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        else:
            flat.append(target)
    return flat


def assignments_into_watched_modules(source: str) -> list[str]:
    """`line: what` for every write into a megatron or torch module in `source`."""
    tree = ast.parse(source)
    names = _bound_names(tree)
    found = []
    for node in ast.walk(tree):
        for target in _assigned(node):
            into_module = (
                isinstance(target, ast.Attribute | ast.Subscript) and _root(target) in names
            )
            if into_module or (isinstance(target, ast.Subscript) and _is_sys_modules(target.value)):
                found.append(f"{node.lineno}: {ast.unparse(target)}")
        if not isinstance(node, ast.Call):
            continue
        func, first = node.func, node.args[0] if node.args else None
        by_name = isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
        if by_name and first is not None and _root(first) in names:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(func, ast.Attribute) and _is_sys_modules(func.value):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


CAUGHT = {
    "import megatron.core.utils\nmegatron.core.utils.get_batch = f\n": "megatron.core.utils",
    "from megatron.training import training\ntraining.train_step = f\n": "training.train_step",
    "from megatron.core import parallel_state as mpu\nsetattr(mpu, name, None)\n": "setattr(mpu",
    "from megatron.core import parallel_state as mpu\nmpu._GROUP += 1\n": "mpu._GROUP",
    "def f(training):\n    training.x, y = 1, 2\nfrom megatron.training import training\n": "x",
    "import torch\ncuda = torch.cuda\ncuda.synchronize = f\n": "cuda.synchronize",
    "from megatron.core.transformer import torch_norm\nw = torch_norm.Norm\nw.__new__ = f\n": "w.",
    "import torch.distributed.checkpoint.filesystem as fs\ndel fs.pickle\n": "fs.pickle",
    "import sys\nsys.modules['megatron.training'] = None\n": "sys.modules[",
    "import sys\nsys.modules.pop('megatron.training')\n": "sys.modules.pop",
    "from megatron.training import arguments\narguments.DEFAULTS['x'] = 1\n": "DEFAULTS",
}
LEFT_ALONE = (
    "from megatron.training import get_args\nget_args().distributed_backend = 'gloo'\n",
    "args = parse()\nargs.rank = 0\nsetattr(args, 'world_size', 1)\n",
    "from megatron.core import parallel_state as mpu\ngroup = mpu.get_data_parallel_group()\n",
    "from . import parallel_state as ps\nps.STATE = 1\n",  # DynaPipe's own modules
    "def f():\n    pass\nf._marker = True\n",
)


@pytest.mark.parametrize("source", CAUGHT, ids=range(len(CAUGHT)))
def test_the_scan_catches_every_form_of_assignment(source) -> None:
    found = assignments_into_watched_modules(source)
    assert len(found) == 1 and CAUGHT[source] in found[0], found


@pytest.mark.parametrize("source", LEFT_ALONE, ids=range(len(LEFT_ALONE)))
def test_the_scan_leaves_other_assignments_alone(source) -> None:
    assert assignments_into_watched_modules(source) == []


def test_only_megatron_hooks_assigns_into_megatron_and_torch() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(RUNTIME.rglob("*.py"))
        if path != HOOKS_MODULE
        for line in assignments_into_watched_modules(path.read_text())
    ]
    assert not offences, (
        "assign into megatron or torch only through megatron_hooks (HOOKS, SWAPS, STATE): "
        + "; ".join(offences)
    )


# install()


def _owners() -> dict[str, Any]:
    """Every loaded megatron or torch module by name, plus each class a hook reaches into by
    its dotted name: what `install()` could change."""
    owners: dict[str, Any] = {
        name: module
        for name, module in list(sys.modules.items())
        if module is not None and _watched(name)
    }
    for hook in HOOKS:
        if "." in hook.attribute:
            owner, _ = megatron_hooks._owner(hook.module, hook.attribute)
            owners[f"{hook.module}.{hook.attribute.rpartition('.')[0]}"] = owner
    return owners


def _snapshot(owners: dict[str, Any]) -> dict[str, Any]:
    """Every attribute of `owners`, by full name (values as stored: a class's staticmethod)."""
    return {
        f"{name}.{attr}": value
        for name, owner in owners.items()
        for attr, value in vars(owner).items()
    }


def _as_got(snapshot: dict[str, Any], hook: Hook) -> Any:
    """What `getattr` gave for `hook`'s target in `snapshot` (a class's staticmethod unwrapped)."""
    value = snapshot[hook.target]
    return value.__func__ if isinstance(value, staticmethod) else value


def _changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    return {name for name, value in after.items() if name in before and before[name] is not value}


@pytest.fixture
def without_hooks(monkeypatch) -> None:
    """Every hook target as megatron-core and torch ship it, restored to what it was after
    the test (as is `megatron_hooks`' record of originals)."""
    monkeypatch.setattr(megatron_hooks, "_ORIGINALS", dict(megatron_hooks._ORIGINALS))
    for hook in HOOKS:
        owner, name = megatron_hooks._owner(hook.module, hook.attribute)
        megatron_hooks.replacement(hook)  # its module loaded before any snapshot
        monkeypatch.setattr(owner, name, _pristine(hook))


def test_install_changes_exactly_the_declared_attributes_once(without_hooks) -> None:
    expected = {
        hook.target: hook for hook in HOOKS if not (hook.cuda_absent and torch.cuda.is_available())
    }
    owners = _owners()
    before = _snapshot(owners)
    megatron_hooks.install()
    after = _snapshot(owners)
    changed = _changed(before, after)
    assert changed == set(expected), (
        f"changed but not declared: {sorted(changed - set(expected))}; "
        f"declared but unchanged: {sorted(set(expected) - changed)}"
    )
    for target, hook in expected.items():
        owner, name = megatron_hooks._owner(hook.module, hook.attribute)
        assert getattr(owner, name) is megatron_hooks.replacement(hook), target
        assert megatron_hooks.original(target) is _as_got(before, hook), target
    megatron_hooks.install()
    assert _changed(after, _snapshot(owners)) == set(), "install() is not idempotent"


def test_install_names_an_unknown_group() -> None:
    with pytest.raises(ValueError, match="no hook group"):
        megatron_hooks.install("loop")


def test_swaps_and_globals_must_be_declared() -> None:
    with (
        pytest.raises(ValueError, match="is not declared"),
        megatron_hooks.swapped("megatron.training.training", "train_step", None),
    ):
        pass
    with pytest.raises(ValueError, match="is not declared"):
        megatron_hooks.assign("megatron.core.parallel_state", {"_NEW_GROUP": None})
    from megatron.training import training

    kept = training.get_num_microbatches
    with megatron_hooks.swapped("megatron.training.training", "get_num_microbatches", len):
        assert training.get_num_microbatches is len
    assert training.get_num_microbatches is kept


def test_a_hook_not_installed_has_no_original() -> None:
    with pytest.raises(RuntimeError, match="is not hooked"):
        megatron_hooks.original("megatron.training.training.no_such_function")


def test_enable_installs_every_hook() -> None:
    """`import megatron.dynapipe.enable` installs every group (importing it here would leave
    this process patched, so its source is read)."""
    assert "megatron_hooks.install()\n" in (RUNTIME / "enable.py").read_text()
