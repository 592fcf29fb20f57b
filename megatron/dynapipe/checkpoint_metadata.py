"""Checkpoint metadata read without running code from it.

torch.distributed.checkpoint keeps a checkpoint's index in `.metadata`, a pickle, which its
`FileSystemReader` loads with `pickle.load` on every torch_dist `--load` (megatron-core's own
loader and DynaPipe's checks alike): whoever can write a checkpoint directory could make that
load run any code. `megatron_hooks` (group CHECKPOINTS) makes that reader load it with
`MetadataUnpickler`, which builds only what the format is made of: the data classes and enums
of torch's checkpoint modules, `torch.Size`, dtypes and layouts. Anything else stops the load
with one line naming the file and the global it asked for (`MetadataRefused`, exit status 2).
The reader is wrapped at its `pickle` seam: torch's own `read_metadata` runs unchanged.

The shards hold pickles too: every non-tensor item of a torch_dist checkpoint (Megatron's
common state: args, iteration, RNG states; its sharded objects) is a byte item that torch's
`DefaultLoadPlanner.load_bytes` reads with `torch.load(..., weights_only=False)`. The same
group makes that planner's `torch.load` weights-only, as torch's own default is since 2.6 and as
megatron-core reads its common state elsewhere (with the classes it registers as safe); a
crafted item then fails torch's check, which names the global it refused.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from pathlib import Path
from typing import IO, Any

import torch

# torch.distributed.checkpoint's modules whose data classes and enums make up `.metadata`.
_FORMAT_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
# Everything else `.metadata` may name: shapes, the layout torch pickles by name, and the
# checkpoint's path (`StorageMeta.checkpoint_id`).
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath")),
}


class MetadataRefused(ValueError):
    """A checkpoint's `.metadata` that names a global the format never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler of torch.distributed.checkpoint's `.metadata` that resolves no global
    beyond the format's own (see the module docstring)."""

    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_dtype(module, name):
            return super().find_class(module, name)
        if module in _FORMAT_MODULES:
            found = super().find_class(module, name)
            if dataclasses.is_dataclass(found) or _is_enum(found):
                return found
        raise MetadataRefused(
            f"{self._name} names {module}.{name}, which checkpoint metadata never holds; not "
            "loading it (a crafted .metadata could run code)"
        )


class _MetadataPickle:
    """`pickle` as torch's checkpoint reader sees it: `load` through `MetadataUnpickler`,
    everything else pickle's own."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(pickle, attr)

    @staticmethod
    def load(file: IO[bytes], **_: Any) -> Any:
        return MetadataUnpickler(file, getattr(file, "name", ".metadata")).load()


def check(directory: Path) -> None:
    """Read `directory`'s `.metadata` (if it has one) as the installed reader will: a crafted
    one stops the job here, in one line, before torch's loaders, which log each failed
    attempt's traceback and try another file before they give up."""
    path = directory / ".metadata"
    if path.is_file():
        with path.open("rb") as file:
            MetadataUnpickler(file, str(path)).load()


class _WeightsOnlyTorch:
    """`torch` as torch's default load planner sees it: `load` weights-only whatever the
    caller asked, everything else torch's own."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(torch, attr)

    @staticmethod
    def load(file: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.load(file, *args, **{**kwargs, "weights_only": True})


# What `megatron_hooks` installs as torch's `FileSystemReader` and default load planner see
# `pickle` and `torch` (group CHECKPOINTS).
METADATA_PICKLE = _MetadataPickle()
WEIGHTS_ONLY_TORCH = _WeightsOnlyTorch()


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _is_enum(found: Any) -> bool:
    return isinstance(found, type) and issubclass(found, enum.Enum)
