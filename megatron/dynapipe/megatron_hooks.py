"""Every attribute of megatron-core, megatron.training and torch that the runtime replaces,
declared as data, and the one function that installs them (`install`).

megatron.training offers no seam for most of what DynaPipe changes: a Megatron-LM program
parses its own flags and calls `pretrain`, whose loop calls module-level functions
(`train_step`, `get_forward_backward_func`, ...) by name, so DynaPipe replaces those names.
Scattered over the runtime such patches break quietly on a megatron-core upgrade (a moved
function leaves its patch dead; a new parameter reaches a wrapper that drops it), so every one
is declared here, with why and the package versions it was tested with:

- `HOOKS`: what `install()` replaces. Each names its replacement, a function (or object) of
  the module that implements it; a replacement reaches what it replaced by `original(target)`.
  The implementations stay in their modules: this one only installs them;
- `SWAPS`: attributes replaced only while one call runs (`swapped`);
- `STATE`: module globals the runtime sets (`assign`).

`tests/unit/test_megatron_hooks.py` checks that every target still exists with the parameters
recorded here, that `install()` changes exactly the `HOOKS`, and that no other module of the
runtime assigns into a megatron or torch module.

Where megatron.training takes an argument for the same thing, that is used instead of a hook:
the `pretrain` hook wraps the program's dataset provider (its `train_valid_test_dataset_provider`
argument) rather than replacing megatron.training's dataset build.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# Package versions each entry was tested with (`megatron-core==0.19.2`, `torch==2.13.0`
# in pyproject.toml); the test fails naming every entry whose package is at another version.
MEGATRON_CORE = ("0.19.2",)
TORCH = ("2.13.0",)

# Groups of hooks, each installed by whoever needs it (`install(group, ...)`; all by default).
CPU = "cpu"  # megatron-core's CUDA calls on a machine without CUDA (`cpu_compat.install`)
CHECKPOINTS = "checkpoints"  # checkpoint reading and writing (`checkpointing.resume_point`)
PARSER = "parser"  # a Megatron-LM program's own parser (`import megatron.dynapipe.enable`)
STARTUP = "startup"  # megatron.training starting on this machine at all
DYNAPIPE = "dynapipe"  # DynaPipe inside megatron.training's `pretrain` and its loop
GROUPS = (CPU, CHECKPOINTS, PARSER, STARTUP, DYNAPIPE)


@dataclass(frozen=True, kw_only=True)
class Hook:
    """`module`.`attribute` replaced by `replacement` (`"<runtime module>:<name>"`, relative to
    `megatron.dynapipe`) when `install()` installs `group`; `cuda_absent`: only on machines
    without CUDA. `parameters`: the replaced function's parameter names (None: not a function)."""

    module: str
    attribute: str  # a dotted name reaches into a class of `module`
    replacement: str
    group: str
    why: str
    parameters: tuple[str, ...] | None
    tested_with: tuple[str, ...] = MEGATRON_CORE
    cuda_absent: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True, kw_only=True)
class Swap:
    """`module`.`attribute` replaced by `by` for the length of one call (`swapped`)."""

    module: str
    attribute: str
    by: str
    why: str
    parameters: tuple[str, ...]
    tested_with: tuple[str, ...] = MEGATRON_CORE

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True, kw_only=True)
class State:
    """Globals of `module` that `by` sets (`assign`): values megatron-core keeps in module
    globals and offers no setter for."""

    module: str
    attributes: tuple[str, ...]
    by: str
    why: str
    tested_with: tuple[str, ...] = MEGATRON_CORE


_TRAINING = "megatron.training.training"
_CUDA_ONLY = "megatron-core calls it unconditionally; on CPU ranks the CPU stands for the GPU"
_RNG = ("device", "clone", "graph_safe")

HOOKS: tuple[Hook, ...] = (
    # Group CHECKPOINTS: checkpoint reading without running code, lean writer processes.
    Hook(
        module="torch.distributed.checkpoint.filesystem",
        attribute="pickle",
        replacement="checkpoint_metadata:METADATA_PICKLE",
        group=CHECKPOINTS,
        why="FileSystemReader unpickles .metadata with any global; it takes no unpickler",
        parameters=None,
        tested_with=TORCH,
    ),
    Hook(
        module="torch.distributed.checkpoint.default_planner",
        attribute="torch",
        replacement="checkpoint_metadata:WEIGHTS_ONLY_TORCH",
        group=CHECKPOINTS,
        why="DefaultLoadPlanner reads byte items with torch.load(weights_only=False)",
        parameters=None,
        tested_with=TORCH,
    ),
    Hook(
        module="megatron.core.dist_checkpointing.strategies.filesystem_async",
        attribute="get_write_results_queue",
        replacement="checkpointing:get_write_results_queue",
        group=CHECKPOINTS,
        why="its manager is spawned re-importing the script, then imports torch to hold results",
        parameters=("mp_mode",),
    ),
    # Group PARSER: the program parses before DynaPipe sees anything; no callback joins it.
    Hook(
        module="megatron.training.arguments",
        attribute="parse_args",
        replacement="arguments:program_parse_args",
        group=PARSER,
        why="DynaPipe's flags, refusals and CPU defaults join the program's own parse",
        parameters=("extra_args_provider", "ignore_unknown_args"),
    ),
    Hook(
        module="megatron.training.arguments",
        attribute="validate_args",
        replacement="arguments:program_validate_args",
        group=PARSER,
        why="Megatron's checks in one line each, DynaPipe's checks after them",
        parameters=("args", "defaults"),
    ),
    # Group STARTUP: megatron.training starting here at all.
    Hook(
        module=_TRAINING,
        attribute="initialize_megatron",
        replacement="cpu_compat:initialize_megatron",
        group=STARTUP,
        cuda_absent=True,
        why="pretrain passes no allow_no_cuda and builds groups and seeds only with a GPU",
        parameters=(
            "allow_no_cuda",
            "skip_mpu_initialization",
            "get_embedding_ranks",
            "get_position_embedding_ranks",
            "store",
            "skip_model_parallel_init",
            "seed_pp_group",
            "seed_dp_group",
            "seed_tp_group",
            "seed_ep_group",
            "seed_etp_group",
            "skip_random_seed",
        ),
    ),
    Hook(
        module="megatron.training.initialize",
        attribute="_warmup_jit_function",
        replacement="cpu_compat:skip_jit_warmup",
        group=STARTUP,
        cuda_absent=True,
        why="its CPU draws would shift the weights; the fusions are off on CPU; no flag skips it",
        parameters=("tp_size",),
    ),
    Hook(
        module="megatron.core.datasets.utils",
        attribute="compile_helpers",
        replacement="megatron_startup:compile_helpers",
        group=STARTUP,
        why="the wheel ships the helpers built but no Makefile for the `make` it runs",
        parameters=(),
    ),
    # Group DYNAPIPE: DynaPipe inside pretrain and its loop.
    Hook(
        module="megatron.training.global_vars",
        attribute="build_tokenizer",
        replacement="megatron_startup:build_tokenizer",
        group=DYNAPIPE,
        why="byte tokenizer without --tokenizer-type, nothing downloaded; initialisation builds it",
        parameters=("args", "kwargs"),
    ),
    *(
        Hook(
            module=module,
            attribute="pretrain",
            replacement="megatron_startup:pretrain",
            group=DYNAPIPE,
            why="checks first, one-line errors, own-loop jobs routed; wraps the dataset provider",
            parameters=(
                "cfg_container",
                "train_valid_test_dataset_provider",
                "model_type",
                "forward_step_func",
                "model_provider",
                "process_non_loss_data_func",
                "get_embedding_ranks",
                "get_position_embedding_ranks",
                "non_loss_data_func",
                "store",
                "inprocess_call_wrapper",
                "p2p_communicator",
                "pg_collection",
                "skip_model_parallel_init",
            ),
        )
        for module in (_TRAINING, "megatron.training")  # the program imports either name
    ),
    Hook(
        module=_TRAINING,
        attribute="build_pretraining_data_loader",
        replacement="megatron_startup:build_pretraining_data_loader",
        group=DYNAPIPE,
        why="a loader nobody reads when DynaPipe plans; the provider's dataset stays as it is",
        parameters=("dataset", "consumed_samples"),
    ),
    Hook(
        module=_TRAINING,
        attribute="build_train_valid_test_data_loaders",
        replacement="megatron_startup:build_train_valid_test_data_loaders",
        group=DYNAPIPE,
        why="no validation without validation data (0.19 would read a None iterator)",
        parameters=("build_train_valid_test_datasets_provider",),
    ),
    Hook(
        module=_TRAINING,
        attribute="load_checkpoint",
        replacement="megatron_startup:load_checkpoint",
        group=DYNAPIPE,
        why="a checkpoint Megatron cannot load named in one line; CPU ranks' dropout stream kept",
        parameters=(
            "ddp_model",
            "optimizer",
            "opt_param_scheduler",
            "load_arg",
            "strict",
            "checkpointing_context",
            "skip_load_to_model_and_opt",
            "tp_group",
            "pp_group",
            "dp_cp_group",
            "dp_group",
            "expt_dp_group",
            "rng_state_key_prefix",
        ),
    ),
    Hook(
        module=_TRAINING,
        attribute="save_checkpoint",
        replacement="megatron_startup:save_checkpoint",
        group=DYNAPIPE,
        why="a save the file system refuses ends the job in one line per rank",
        parameters=(
            "iteration",
            "model",
            "optimizer",
            "opt_param_scheduler",
            "num_floating_point_operations_so_far",
            "checkpointing_context",
            "pipeline_rank",
            "expert_rank",
            "tensor_rank",
            "pipeline_parallel",
            "expert_parallel",
            "non_persistent_ckpt",
            "train_data_iterator",
            "preprocess_common_state_dict_fn",
            "release",
            "tp_group",
            "pp_group",
            "dp_cp_group",
            "dp_group",
            "expt_dp_group",
            "rng_state_key_prefix",
        ),
    ),
    Hook(
        module=_TRAINING,
        attribute="get_forward_backward_func",
        replacement="megatron_loop:get_forward_backward_func",
        group=DYNAPIPE,
        why="DynaPipe's planned schedule where train() asks for megatron-core's",
        parameters=("pp_size", "vp_size", "schedule_pg_collection"),
    ),
    Hook(
        module=_TRAINING,
        attribute="train_step",
        replacement="megatron_loop:train_step",
        group=DYNAPIPE,
        why="guarded, timed and followed by DynaPipe's iteration line; samples counted",
        parameters=(
            "forward_step_func",
            "data_iterator",
            "model",
            "optimizer",
            "opt_param_scheduler",
            "config",
            "forward_backward_func",
            "iteration",
            "pg_collection",
            "p2p_communicator",
        ),
    ),
    Hook(
        module=_TRAINING,
        attribute="train",
        replacement="megatron_loop:train",
        group=DYNAPIPE,
        why="its collectives outside train_step also name the ranks that stopped answering",
        parameters=(
            "forward_step_func",
            "model",
            "optimizer",
            "opt_param_scheduler",
            "train_data_iterator",
            "valid_data_iterator",
            "process_non_loss_data_func",
            "config",
            "checkpointing_context",
            "non_loss_data_func",
            "inference_model",
            "p2p_communicator",
            "pg_collection",
        ),
    ),
    Hook(
        module=_TRAINING,
        attribute="training_log",
        replacement="megatron_loop:training_log",
        group=DYNAPIPE,
        why="its global batch size and FLOPs count the planned batch",
        parameters=(
            "loss_dict",
            "total_loss_dict",
            "learning_rate",
            "iteration",
            "loss_scale",
            "report_memory_flag",
            "skipped_iter",
            "grad_norm",
            "params_norm",
            "num_zeros_in_grad",
            "max_attention_logit",
            "pg_collection",
            "is_first_iteration",
            "seqlen_squared_sum_in_batch",
            "total_real_tokens_in_batch",
        ),
    ),
    Hook(
        module="megatron.core.utils",
        attribute="get_batch_on_this_tp_rank",
        replacement="megatron_loop:get_batch_on_this_tp_rank",
        group=DYNAPIPE,
        why="TP rank 0 broadcasts the planned micro-batch's shape first; get_batch calls it",
        parameters=(
            "batch",
            "has_cu_seqlens",
            "is_hybrid_cp",
            "create_attention_mask_in_dataloader",
            "broadcast_src_rank",
            "broadcast_group",
            "cp_size",
            "tp_rank",
            "micro_batch_size",
            "seq_length",
            "mtp_on_this_rank",
            "pipeline_model_parallel_size",
            "is_pipeline_first_stage",
            "is_pipeline_last_stage",
        ),
    ),
    # Group CPU: megatron-core's CUDA calls on CPU ranks (`cpu_compat`). Last: whatever the
    # other groups import loads before torch.cuda is replaced.
    *(
        Hook(
            module="torch.cuda",
            attribute=name,
            replacement=f"cpu_compat:{replacement}",
            group=CPU,
            cuda_absent=True,
            why=why,
            parameters=parameters,
            tested_with=TORCH,
        )
        for name, replacement, parameters, why in (
            ("current_device", "cuda_current_device", (), _CUDA_ONLY),
            ("synchronize", "cuda_synchronize", ("device",), "CPU work is already ordered"),
            ("current_stream", "null_stream", ("device",), "CPU work is already ordered"),
            ("default_stream", "null_stream", ("device",), "CPU work is already ordered"),
            (
                "Stream",
                "NullStream",
                ("device", "priority", "kwargs"),
                "a stream that waits on nothing",
            ),
            (
                "Event",
                "NullStream",
                ("enable_timing", "blocking", "interprocess", "external"),
                "an event that waits on nothing",
            ),
            ("stream", "cuda_stream", ("stream",), "CPU work is already ordered"),
            ("get_rng_state", "cuda_get_rng_state", ("device",), "the CPU generator is the GPU's"),
            (
                "set_rng_state",
                "cuda_set_rng_state",
                ("new_state", "device"),
                "the CPU generator is the GPU's",
            ),
            ("manual_seed", "cuda_manual_seed", ("seed",), "the CPU generator is the GPU's"),
            (
                "manual_seed_all",
                "cuda_manual_seed_all",
                ("seed",),
                "one generator, seeded by manual_seed",
            ),
        )
    ),
    Hook(
        module="megatron.core.tensor_parallel.random",
        attribute="_get_cuda_rng_state",
        replacement="cpu_compat:cuda_get_rng_state",
        group=CPU,
        cuda_absent=True,
        why="the TP RNG tracker reads the GPU generator through it; no argument selects another",
        parameters=_RNG,
    ),
    Hook(
        module="megatron.core.tensor_parallel.random",
        attribute="_set_cuda_rng_state",
        replacement="cpu_compat:cuda_set_rng_state",
        group=CPU,
        cuda_absent=True,
        why="the TP RNG tracker sets the GPU generator through it; no argument selects another",
        parameters=("new_state", "device", "graph_safe"),
    ),
    Hook(
        module="megatron.core.transformer.torch_norm",
        attribute="WrappedTorchNorm.__new__",
        replacement="cpu_compat:sequence_parallel_norm",
        group=CPU,
        cuda_absent=True,
        why="the local spec's norm refuses sequence_parallel, which the GPU norms take",
        parameters=(
            "cls",
            "config",
            "hidden_size",
            "eps",
            "persist_layer_norm",
            "zero_centered_gamma",
            "normalization",
        ),
    ),
)

SWAPS: tuple[Swap, ...] = (
    Swap(
        module=_TRAINING,
        attribute="get_num_microbatches",
        by="megatron_loop:training_log",
        why="training_log multiplies it into its global batch size; the planned batch's samples",
        parameters=(),
    ),
    Swap(
        module="megatron.training.arguments",
        attribute="get_device_arch_version",
        by="arguments:_megatron_checks_on_cpu",
        why="validate_args asks the GPU's architecture with TP > 1; a CPU answers pre-Blackwell",
        parameters=(),
    ),
    Swap(
        module="torch.cuda",
        attribute="device_count",
        by="cpu_compat:_one_cuda_device",
        why="initialize_megatron builds groups and seeds only when it counts a device",
        parameters=(),
        tested_with=TORCH,
    ),
    Swap(
        module="torch.cuda",
        attribute="set_device",
        by="cpu_compat:_one_cuda_device",
        why="initialize_megatron selects the device it counted",
        parameters=("device",),
        tested_with=TORCH,
    ),
)

STATE: tuple[State, ...] = (
    State(
        module="megatron.core.dist_checkpointing.strategies.filesystem_async",
        attributes=("_results_queue",),
        by="checkpointing:release_writer_processes",
        why="the writer's manager process is never stopped; the queue holding it is dropped",
    ),
)

# What each installed hook's target held before (`original`), by target.
_ORIGINALS: dict[str, Any] = {}


def _owner(module: str, attribute: str) -> tuple[Any, str]:
    """The object holding `attribute` (a module, or a class in it) and the last name."""
    owner: Any = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def replacement(hook: Hook) -> Any:
    """The object `hook` installs (its module imported)."""
    module, name = hook.replacement.split(":")
    return getattr(importlib.import_module(f"megatron.dynapipe.{module}"), name)


def install(*groups: str) -> None:
    """Install the `HOOKS` of `groups` (every group when none is named), keeping what each
    target held for `original`. Idempotent: a target that already holds its replacement is
    left alone, so installing again (or from another entry point) wraps nothing twice; one
    restored meanwhile (a test's monkeypatch) is installed afresh."""
    import torch

    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"no hook group {sorted(unknown)}; groups: {', '.join(GROUPS)}")
    chosen = groups or GROUPS
    cuda = torch.cuda.is_available()
    for hook in HOOKS:
        if hook.group not in chosen or (hook.cuda_absent and cuda):
            continue
        owner, name = _owner(hook.module, hook.attribute)
        new = replacement(hook)
        current = getattr(owner, name)
        if current is new:
            continue
        _ORIGINALS[hook.target] = current
        setattr(owner, name, new)


def original(target: str) -> Any:
    """What hook `target` (`"<module>.<attribute>"`) replaced, for its replacement to call."""
    try:
        return _ORIGINALS[target]
    except KeyError:
        raise RuntimeError(f"{target} is not hooked (megatron_hooks.install)") from None


def _declared(entries: tuple[Swap, ...] | tuple[State, ...], module: str, name: str) -> None:
    """Refuse an attribute no entry declares, and one the module no longer has (megatron-core
    renamed it: setting it would change nothing megatron-core reads)."""
    for entry in entries:
        names = entry.attributes if isinstance(entry, State) else (entry.attribute,)
        if entry.module == module and name in names:
            break
    else:
        raise ValueError(f"{module}.{name} is not declared in megatron_hooks")
    if not hasattr(importlib.import_module(module), name):
        raise AttributeError(f"{module} has no {name} (megatron_hooks declares it)")


@contextlib.contextmanager
def swapped(module: str, attribute: str, value: Any) -> Iterator[None]:
    """`module`.`attribute` (declared in `SWAPS`) is `value` inside the block, and what it was
    after it."""
    _declared(SWAPS, module, attribute)
    owner = importlib.import_module(module)
    saved = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)


def assign(module: str, values: Mapping[str, Any]) -> None:
    """Set globals of `module` (each declared in `STATE`)."""
    for name in values:
        _declared(STATE, module, name)
    owner = importlib.import_module(module)
    for name, value in values.items():
        setattr(owner, name, value)
