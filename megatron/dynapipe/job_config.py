"""`JobConfig`: what DynaPipe decided about a job, in one typed, frozen object.

Megatron's parsed flags are an `argparse.Namespace` that Megatron's own code reads and writes
(`validate_args`, its loop, its checkpoints). DynaPipe's flags arrive in the same namespace,
but what DynaPipe derives from them (whether it plans at all, the batching method a baseline
implies, the recomputation mode, the one timeout of every wait, the start-up notes) used to be
written back into it, next to Megatron's values, and read back wherever a function happened to
hold `args`. Here it is decided once, when the flags are validated
(`arguments._check_dynapipe`), and kept in a frozen dataclass that the runtime passes down
explicitly: one place decides the job, a type says what each value is, and nothing changes it
behind a reader's back. Megatron's args stay Megatron's: the only writes into them are the ones
Megatron's own code needs to read (`arguments.megatron_settings` names each).

Megatron's values (sizes, iterations, seeds, paths) stay in Megatron's args, where Megatron's
loop, optimiser and checkpoints read them and where `--parallel-plan` sets TP, PP and the batch
after validation; the runtime reads those from `args`. So does the global batch, whichever
flag defines it (`--global-batch-size` samples or DynaPipe's `--tokens-per-global-batch`).

The hooks Megatron calls with only its args (`get_args()`) find the same object again with
`JobConfig.of(args)`: each config is kept per args object, for as long as that object lives.
"""

from __future__ import annotations

import argparse
import weakref
from dataclasses import dataclass

from dynapipe_planner.cluster import GiB

from .device_speed import parse_device_speed


class PerArgs[V]:
    """A value per args object, kept while that object lives. An `argparse.Namespace` compares
    by its contents and so cannot be a dictionary key (nor a `WeakKeyDictionary`'s): values are
    keyed by the object's identity, and dropped when it is collected."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, args: argparse.Namespace) -> V | None:
        entry = self._values.get(id(args))
        return entry[1] if entry is not None and entry[0]() is args else None

    def set(self, args: argparse.Namespace, value: V) -> None:
        key = id(args)

        def forget(ref: weakref.ref) -> None:
            if self._values.get(key, (None,))[0] is ref:
                del self._values[key]

        self._values[key] = (weakref.ref(args, forget), value)

    def pop(self, args: argparse.Namespace, default: V) -> V:
        value = self.get(args)
        if value is None:
            return default
        del self._values[id(args)]
        return value


@dataclass(frozen=True)
class HeteroConfig:
    """The flags of heterogeneous jobs (`--dynamic-strategies`, `--hetero-plan`)."""

    dynamic_strategies: bool
    hetero_plan: str | None
    strategy_candidates: str | None
    strategy_window: int | None
    max_cached_strategies: int
    overlap_pull_push: bool

    @property
    def enabled(self) -> bool:
        """Whether the job is heterogeneous (its own loop, `layouts.training`)."""
        return self.dynamic_strategies or self.hetero_plan is not None


@dataclass(frozen=True)
class JobConfig:
    """DynaPipe's flags and what is derived from them, for one job.

    `plans`: DynaPipe plans the iterations (`plans`); `batching`: the micro-batching
    method, resolved (a baseline's, the flag's, or dynamic/padding by `--dynamic-micro-batching`);
    `recompute`: the recomputation mode, resolved from `--dynapipe-recompute` and Megatron's
    `--recompute-granularity` ("none" under `--parallel-plan`, whose layers say it);
    `timeout_s`: the smaller of `--dynapipe-timeout` and `--distributed-timeout-minutes` given;
    `notes`: what start-up says once about the flags (CPU defaults, per-sample attention, unused
    flags).
    """

    plans: bool
    batching: str
    recompute: str
    timeout_s: float
    notes: tuple[str, ...]
    pipeline_schedule: str
    baseline: str | None
    packed_rows: str
    gpu: str
    cost_model: str
    memory_limit_gib: float | None
    planner_workers: int
    log_peak_memory: bool
    device_speed: str | None
    parallel_plan: str | None
    hetero: HeteroConfig

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        given: dict[str, str],
        notes: tuple[str, ...] = (),
    ) -> JobConfig:
        """The config of `args` once validated, built from them and the flags the user typed
        (`given`, by destination; `notes` from before validation come first). Built once per
        args object: a second call returns the first one's config. It reads `args` and writes
        nothing; Megatron's settings follow from the config (`arguments.megatron_settings`)."""
        known = _CONFIGS.get(args)
        if known is not None:
            return known
        planned = plans(args)
        config = cls(
            plans=planned,
            batching=_batching(args),
            recompute=_recompute(args, planned),
            timeout_s=_timeout_s(args, given),
            notes=(*notes, *_notes(args, given, planned)),
            pipeline_schedule=args.pipeline_schedule,
            baseline=args.baseline,
            packed_rows=args.dynapipe_packed_rows,
            gpu=args.dynapipe_gpu,
            cost_model=args.dynapipe_cost_model,
            memory_limit_gib=args.dynapipe_memory_limit_gib,
            planner_workers=args.planner_workers,
            log_peak_memory=args.log_peak_memory,
            device_speed=args.device_speed,
            parallel_plan=args.parallel_plan,
            hetero=HeteroConfig(
                dynamic_strategies=args.dynamic_strategies,
                hetero_plan=args.hetero_plan,
                strategy_candidates=args.strategy_candidates,
                strategy_window=args.strategy_window,
                max_cached_strategies=args.max_cached_strategies,
                overlap_pull_push=args.overlap_pull_push,
            ),
        )
        _CONFIGS.set(args, config)
        return config

    @classmethod
    def of(cls, args: argparse.Namespace) -> JobConfig:
        """The config built when `args` were validated (`from_args`): what a hook that Megatron
        calls with its args alone reads DynaPipe's decisions from."""
        config = _CONFIGS.get(args)
        if config is None:
            raise LookupError(
                "these arguments were not validated by megatron.dynapipe.arguments "
                "(parse_args, or a Megatron-LM program after `import megatron.dynapipe.enable`)"
            )
        return config

    @property
    def schedule(self) -> str:
        """The pipeline schedule the planner uses: `--pipeline-schedule` with dynamic
        micro-batching, 1F1B for the fixed-size baselines."""
        return self.pipeline_schedule if self.batching == "dynamic" else "1f1b"

    @property
    def memory_limit_bytes(self) -> int:
        """`--dynapipe-memory-limit-gib` in bytes; 0 lets the planner use the device's memory."""
        return int(self.memory_limit_gib * GiB) if self.memory_limit_gib else 0

    def slowdowns(self, world_size: int) -> list[float]:
        """Every rank's `--device-speed` factor (1 everywhere without the flag)."""
        return parse_device_speed(self.device_speed, world_size)


# The config of each validated args object (`JobConfig.from_args`, `JobConfig.of`).
_CONFIGS: PerArgs[JobConfig] = PerArgs()


# DynaPipe's flags that make it plan a job's iterations (`plans`), by destination.
PLANNING_FLAGS = (
    "dynamic_micro_batching", "batching", "baseline", "dynamic_strategies", "hetero_plan",
    "parallel_plan",
)  # fmt: skip


def plans(args: argparse.Namespace) -> bool:
    """Whether DynaPipe plans the job's iterations: a batching flag (`--baseline packing-1f1b`
    batches by packing), or a job only DynaPipe's loop runs. Otherwise Megatron trains as it
    would without DynaPipe (`--baseline megatron-1f1b` names that). Read from the flags as
    parsed, also before Megatron validates them (`arguments.unsupported`)."""
    packing = args.baseline == "packing-1f1b"
    return bool(
        args.dynamic_micro_batching or args.batching is not None or packing
    ) or runs_in_own_loop(args)


def runs_in_own_loop(args: argparse.Namespace) -> bool:
    """Whether the job needs DynaPipe's own loop (`training.pretrain`) rather than
    megatron.training's. Megatron's loop trains one model layout with one optimiser over one
    set of parallel groups; these jobs change the layout per iteration (`--dynamic-strategies`),
    run pipelines of different shapes side by side (`--hetero-plan`), or shard some layers and
    not others (`--parallel-plan`)."""
    return bool(args.dynamic_strategies or args.hetero_plan or args.parallel_plan)


def _batching(args: argparse.Namespace) -> str:
    """`--baseline packing-1f1b` packs; otherwise `--batching`, by default dynamic with
    `--dynamic-micro-batching` and padding to `--micro-batch-size` without (also under
    `--parallel-plan`, which refuses the batching flags)."""
    if args.baseline == "packing-1f1b":
        return "packing"
    if args.batching is not None:
        return args.batching
    return "dynamic" if args.dynamic_micro_batching else "padding"


def _recompute(args: argparse.Namespace, planned: bool) -> str:
    """One recomputation mode (`arguments._check_recompute` refuses flags that disagree):
    Megatron's `--recompute-granularity` fixes it, `--dynapipe-recompute` also offers auto (the
    default). Where DynaPipe does not plan, Megatron's mode, or auto. A `--parallel-plan`
    recomputes exactly its plan's layers, no mode per iteration: "none"."""
    megatron_mode = args.recompute_granularity
    if not planned and args.dynapipe_recompute is None:
        return megatron_mode or "auto"
    if args.parallel_plan is not None:
        return "none"
    return megatron_mode or args.dynapipe_recompute or "auto"


def _timeout_s(args: argparse.Namespace, given: dict[str, str]) -> float:
    """One timeout bounds every wait of a job: `--dynapipe-timeout` (seconds) and Megatron's
    `--distributed-timeout-minutes` agree, the smaller given one wins (both default to 10
    minutes)."""
    given_s = [60.0 * args.distributed_timeout_minutes] * ("distributed_timeout_minutes" in given)
    given_s += [args.dynapipe_timeout] * ("dynapipe_timeout" in given)
    return min(given_s) if given_s else args.dynapipe_timeout


def _notes(args: argparse.Namespace, given: dict[str, str], planned: bool) -> list[str]:
    """What start-up says once about the flags validation read."""
    notes = []
    if planned and not args.dataloader_inter_document_masking:
        notes.append(
            "per-sample attention: --dataloader-inter-document-masking on (THD micro-batches)"
        )
    if _batching(args) == "dynamic" and "micro_batch_size" in given:
        notes.append(
            f"--micro-batch-size {args.micro_batch_size} is not used: dynamic micro-batching "
            "plans every micro-batch"
        )
    return notes
