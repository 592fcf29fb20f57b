"""Lets unmodified megatron-core models, DDP and optimisers run on CPU with gloo.

megatron-core hard-codes CUDA in a few dozen places (device queries, `device="cuda"` literals,
stream synchronisation, the tensor-parallel RNG tracker). `install()` redirects exactly those
to the CPU when no GPU is present, and does nothing at all when CUDA is available, so the same
program runs on a laptop, in CI and on a cluster.

The attributes it replaces are `megatron_hooks`' (group CPU); what megatron.training's own
loop (`pretrain`) needs on top, initialising without CUDA (gloo, megatron-core's groups and
seeds, which it builds only when it sees a GPU), is the group STARTUP's
(`initialize_megatron`, `skip_jit_warmup`).

Every intercepted call records its first Megatron frame (`megatron/core/<file>:<function>` or
`megatron/training/...`). `recorded_call_sites()` returns that set; a test compares it with a
checked-in list, so a megatron-core upgrade that adds a new CUDA call site is noticed instead
of silently patched.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_TENSOR_TYPE, _TENSOR_CUDA, _TENSOR_TO = torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.to
_call_sites: set[str] = set()
_installed = False
_mode: TorchFunctionMode | None = None


def recorded_call_sites() -> set[str]:
    """The Megatron call sites (`megatron/core/<file>:<function>`, `megatron/training/...`)
    redirected so far."""
    return set(_call_sites)


def _record(depth: int = 2) -> None:
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for package in ("/megatron/core/", "/megatron/training/"):
            if package in path:
                rel = package[1:] + path.rsplit(package, 1)[1]
                _call_sites.add(f"{rel}:{frame.f_code.co_name}")
                return
        frame = frame.f_back


def _called_from_megatron_core() -> bool:
    """Whether the torch call being handled was made by megatron-core's own code (the frame
    above the function mode and torch's dispatch)."""
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename.replace("\\", "/"):
        frame = frame.f_back
    return frame is not None and "/megatron/core/" in frame.f_code.co_filename.replace("\\", "/")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int names a CUDA ordinal in `device=` arguments.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call.

    Attribute patches cannot reach literals such as `torch.zeros(1, device="cuda")` in the
    schedules and optimiser, or `tensor.cuda()`; a function mode sees every call's arguments.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process passes here: the common one, with no CUDA device in
        # sight, costs a few identity tests and no allocation.
        if func is _TENSOR_TYPE:
            if len(args) == 1 and not kwargs:
                # megatron-core tells fp32, fp16 and bf16 tensors apart by their legacy type
                # names (`param.type() == "torch.cuda.FloatTensor"` in its optimisers and
                # gradient clipping); on the CPU those names lack ".cuda", so it sees CUDA's.
                name = func(*args)
                if name.startswith("torch.") and _called_from_megatron_core():
                    _record()
                    return name.replace("torch.", "torch.cuda.", 1)
                return name
        elif func is _TENSOR_CUDA:
            _record()
            return args[0]
        elif func is _TENSOR_TO and len(args) > 1 and _is_cuda(args[1]):
            _record()
            args = (args[0], _CPU, *args[2:])
        if not kwargs:
            return func(*args)
        if _is_cuda(kwargs.get("device")):
            _record()
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


class NullStream:
    """Stands in for a CUDA stream or event: CPU ops are already ordered, so waits do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _record()

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> NullStream:
        return NullStream()

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _record()
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "redirect")
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _get_cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    state = torch.default_generator.get_state()
    return state.clone() if kwargs.get("clone") else state


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.default_generator.set_state(new_state)


# What `megatron_hooks` installs in torch.cuda and megatron-core on CPU ranks (group CPU).
# Device queries: tensors are placed with `device=torch.cuda.current_device()`.
cuda_current_device = _recording(lambda: _CPU)
# Streams and events order GPU kernels; CPU work is synchronous, so they become no-ops.
cuda_synchronize = _recording(lambda *a, **k: None)
cuda_stream = _recording(lambda *a, **k: contextlib.nullcontext())
# RNG: the "CUDA" generator becomes the CPU default generator. `torch.manual_seed` must not be
# used for `cuda.manual_seed`: it calls `cuda.manual_seed_all`, which would recurse.
cuda_get_rng_state = _recording(_get_cpu_rng_state)
cuda_set_rng_state = _recording(_set_cpu_rng_state)
cuda_manual_seed = _recording(lambda seed: torch.default_generator.manual_seed(seed))
cuda_manual_seed_all = _recording(lambda seed: None)


def null_stream(*args: Any, **kwargs: Any) -> NullStream:
    """`torch.cuda.current_stream` and `default_stream` on a CPU rank."""
    return NullStream()


def install() -> bool:
    """Redirect megatron-core's CUDA call sites to the CPU: `megatron_hooks`' group CPU
    (device queries, streams, the CUDA generator as the TP RNG tracker reads it, sequence
    parallelism in the torch norm) and a function mode for the CUDA devices torch calls name.
    Idempotent.

    Returns True when the redirects are active, False when CUDA is available (nothing patched).
    """
    global _installed, _mode
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    from . import megatron_hooks

    megatron_hooks.install(megatron_hooks.CPU)  # torch.cuda's first, before megatron-core loads
    from megatron.core.tensor_parallel import random as tp_random

    # With one generator for "CPU" and "CUDA", every tracker fork changes the CPU state and
    # the tracker would warn each time.
    logging.getLogger(tp_random.__name__).setLevel(logging.ERROR)
    _mode = _CudaToCpu()
    _mode.__enter__()
    _installed = True
    return True


def sequence_parallel_norm(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """Sequence parallelism on CPU ranks (`WrappedTorchNorm.__new__`). The local spec's norm
    (`WrappedTorchNorm`: torch's LayerNorm or RMSNorm, what runs without apex and
    TransformerEngine) refuses `sequence_parallel`; the GPU norms take it and mark their
    weights `sequence_parallel`, so `finalize_model_grads` sums their gradients over the
    tensor-parallel group (each rank normalised only its own share of the tokens). The same
    torch norm, marked the same way, is exactly that: a norm acts on each token alone."""
    from . import megatron_hooks

    build = megatron_hooks.original("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__")
    if not config.sequence_parallel:
        return build(cls, config, *args, **kwargs)
    _record()
    config.sequence_parallel = False  # only for the norm's own check
    try:
        norm = build(cls, config, *args, **kwargs)
    finally:
        config.sequence_parallel = True
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


@contextlib.contextmanager
def _one_cuda_device() -> Iterator[None]:
    """megatron.training builds megatron-core's groups and seeds the TP RNG tracker only when
    `torch.cuda.device_count() > 0`; on a CPU rank it sees one device, whose selection is a
    no-op (the redirects above carry the rest)."""
    from .megatron_hooks import swapped

    with (
        swapped("torch.cuda", "device_count", lambda: 1),
        swapped("torch.cuda", "set_device", lambda *args, **kwargs: None),
    ):
        _record(3)
        yield


def skip_jit_warmup(*args: Any, **kwargs: Any) -> None:
    """megatron.training's warm-up of the CUDA JIT fusions (`_warmup_jit_function`), skipped on
    CPU ranks: the fusions are off on CPU, and its random inputs, drawn from the CPU generator
    here (a GPU draws them from its own), would change the weights drawn after it."""
    _record()


def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's initialisation on a CPU rank: as if CUDA were allowed to be
    missing, over gloo, with megatron-core's groups and seeds set up as on a GPU."""
    from megatron.training import get_args

    from . import megatron_hooks

    initialize = megatron_hooks.original("megatron.training.training.initialize_megatron")
    get_args().distributed_backend = "gloo"  # NCCL needs GPUs
    kwargs["allow_no_cuda"] = True
    with _one_cuda_device():
        return initialize(*args, **kwargs)


# The CUDA generator's state a checkpoint load restored on this CPU rank (`keep_dropout_stream`).
_RESTORED: dict[str, torch.Tensor] = {}


def keep_dropout_stream(load_result: Any) -> None:
    """After Megatron's checkpoint load (`load_result`: what it returned), on CPU ranks. A GPU rank
    keeps two generators: the CPU's, which data loaders draw their seeds from, and the GPU's,
    which dropout draws from. A CPU rank has one for both (`install`). Megatron's checkpoint
    load restores both (the GPU's last), but the data loaders it builds after the load then
    draw from the restored dropout stream, so a resumed run's dropout would differ from the
    uninterrupted run's. The state the load restored is set again as the first training step
    after it starts (`resume_dropout_stream`), where a GPU's dropout stream would stand."""
    from megatron.training import get_args

    if not _installed:
        return
    job = get_args()
    loaded = isinstance(load_result, tuple) and load_result and load_result[0]
    if loaded and not (job.no_load_rng or job.finetune):
        _RESTORED["dropout"] = torch.cuda.get_rng_state()


def resume_dropout_stream() -> None:
    """Before a training step: the dropout stream a checkpoint load restored, set again
    (`keep_dropout_stream`)."""
    state = _RESTORED.pop("dropout", None)
    if state is not None:
        torch.cuda.set_rng_state(state)
