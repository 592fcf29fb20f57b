"""`dynapipe-strategy`: Hydraulis strategy planning from the command line.

`dynapipe-strategy propose` profiles every parallel scheme of the model on the GPUs (MaxLen,
UtilLen, T(l) fit) and proposes, for every maximum sequence length of the dataset's histogram,
the candidate heterogeneous strategies the per-iteration selection will choose from (seed
hydraulis.txt §7). It prints both tables and can write them as JSON. `dynapipe-strategy plan`
then chooses and plans the strategy of each sampled global batch (§4, §6) and can write the
heterogeneous ExecutionPlans.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cli_args import (
    OneLineParser,
    add_cluster_flags,
    add_memory_limit_flag,
    add_renamed,
    check_output_dir,
    check_output_file,
    positive_int,
    report_error,
    sample_count,
    seed,
    sequence_length,
)
from ..cluster import GiB, get_gpu
from ..data import PRESETS, global_batches, load_lengths, sample_lengths
from ..errors import PlanningError
from ..model_spec import MODEL_PRESETS, load_model_spec
from ..plan import atomic_write
from .proposal import IntervalWork, Proposal, interval_work, propose_strategies, unique_candidates
from .schemes import (
    AnalyticSchemeModels,
    SchemeProfile,
    analytic_scheme_models,
    profile_schemes,
    scheme_space,
    scheme_tables,
)
from .selection import INSIDE, SelectionConfig, StrategySelector


def trials(text: str) -> int:
    """Greedy dispatch trials: each is a pass over the batch; a million is past any use."""
    value = positive_int(text)
    if value > 1_000_000:
        raise argparse.ArgumentTypeError(f"{text} is more than 1000000 trials")
    return value


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dynapipe-strategy", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    propose = sub.add_parser("propose", help="candidate heterogeneous strategies (§7)")
    plan = sub.add_parser("plan", help="choose and plan each iteration's strategy (§4, §6)")
    for command in (propose, plan):
        _add_job_args(command)
    out = propose.add_argument_group("output")
    out.add_argument("--output", help="write schemes and proposals as JSON")
    steps = plan.add_argument_group("planning")
    steps.add_argument("--iterations", type=positive_int, default=3, help="global batches to plan")
    steps.add_argument("--inside", choices=INSIDE, default="dynapipe", help="within pipelines")
    steps.add_argument("--trials", type=trials, default=100, help="greedy dispatch trials (D.2)")
    out = plan.add_argument_group("output")
    out.add_argument("--output-dir", help="write each iteration's heterogeneous plan here")
    out.add_argument("--format", choices=("json", "bin"), default="json")
    return p


# dynapipe-strategy's spellings before #35, refused with their replacement.
STRATEGY_RENAMED = {
    "--tokens-per-iteration": "--tokens-per-global-batch",
    "--context-length": "--seq-length",
    "--memory-limit-gb": "--memory-limit-gib",
}


def _add_job_args(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data")
    src = data.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="lengths file: .txt, .npy, .jsonl, or Megatron .idx/.bin")
    src.add_argument("--preset", choices=sorted(PRESETS), help="synthetic length distribution")
    data.add_argument(
        "--num-samples", type=sample_count, default=100000, help="samples from a preset"
    )
    data.add_argument("--seed", type=seed, default=0, help="sampling and batching seed")
    data.add_argument(
        "--seq-length",
        type=sequence_length,
        default=32768,
        help="truncate samples to this many tokens (the longest sequence planned for)",
    )
    data.add_argument(
        "--tokens-per-global-batch",
        type=positive_int,
        default=200000,
        help="tokens per global batch (as many whole samples as fit)",
    )
    data.add_argument(
        "--length-step", type=positive_int, default=128, help="histogram interval width"
    )
    model = p.add_argument_group("model")
    model.add_argument("--model", default="gpt-6.7b", help=f"{', '.join(MODEL_PRESETS)} or JSON")
    cluster = p.add_argument_group("cluster")
    add_cluster_flags(cluster, 64)
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--max-tp", type=positive_int, default=8, help="largest TP degree (NVLink island)"
    )
    memory = p.add_argument_group("memory")
    add_memory_limit_flag(memory)
    memory.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    strategies = p.add_argument_group("strategies")
    strategies.add_argument(
        "--keep", type=positive_int, default=3, help="strategies kept per maximum length"
    )
    add_renamed(p, STRATEGY_RENAMED)


def strategy_main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "propose":
        check_output_file(parser, "--output", args.output)
    else:
        check_output_dir(parser, "--output-dir", args.output_dir)
    try:
        return _propose(args) if args.command == "propose" else _plan(args)
    except PlanningError as e:
        report_error("dynapipe-strategy", e, args)
        return 2


@dataclass
class _Job:
    """What both subcommands derive from the flags: data, scheme models, profiles, proposals."""

    lengths: np.ndarray
    models: AnalyticSchemeModels
    profiles: list[SchemeProfile]
    iw: IntervalWork
    proposals: list[Proposal]
    profiling_s: float
    proposal_s: float


def _job(args: argparse.Namespace) -> _Job:
    model = load_model_spec(args.model)
    if args.lengths:
        lengths = load_lengths(args.lengths)
        if lengths.ndim != 1:
            raise PlanningError(
                f"{args.lengths}: input and target lengths per sample; Hydraulis strategies "
                "are planned for one sequence per sample (decoder-only models)"
            )
    else:
        lengths = sample_lengths(args.preset or "webcode", args.num_samples, seed=args.seed)
    lengths = np.minimum(lengths, args.seq_length)
    if args.tokens_per_global_batch < lengths.max():
        raise PlanningError(
            f"--tokens-per-global-batch {args.tokens_per_global_batch} cannot hold the longest "
            f"sample ({lengths.max()} tokens); a global batch holds whole samples (--seq-length "
            "truncates)"
        )
    started = time.perf_counter()
    models = analytic_scheme_models(
        model,
        get_gpu(args.gpu),
        args.num_gpus,
        gpus_per_node=args.gpus_per_node,
        memory_limit_bytes=int(args.memory_limit_gib * GiB),
    )
    schemes = scheme_space(model, args.num_gpus, max_tp=args.max_tp)
    profiles = profile_schemes(schemes, scheme_tables(models, args.seq_length, args.recompute))
    profiled = time.perf_counter()
    iw = interval_work(
        lengths, profiles, step=args.length_step, tokens_per_iteration=args.tokens_per_global_batch
    )
    proposals = propose_strategies(iw, args.num_gpus, keep=args.keep)
    done = time.perf_counter()
    return _Job(lengths, models, profiles, iw, proposals, profiled - started, done - profiled)


def _propose(args: argparse.Namespace) -> int:
    job = _job(args)
    print(_scheme_table(job.profiles))
    print()
    print(_proposal_table(job.proposals, job.iw))
    print(
        f"\n{len(unique_candidates(job.proposals))} candidate strategies on {args.num_gpus} "
        f"{args.gpu}; profiling {job.profiling_s:.2f} s, proposal {job.proposal_s:.2f} s"
    )
    if args.output:
        payload = json.dumps(_to_json(job.profiles, job.proposals), indent=1).encode()
        atomic_write(Path(args.output), payload)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Per iteration: the chosen strategy, its planned latency and that of the best homogeneous
    candidate on the same batch (with the default planned estimate); plans written as
    heterogeneous ExecutionPlans."""
    job = _job(args)
    config = SelectionConfig(inside=args.inside, trials=args.trials, recompute=args.recompute)
    selector = StrategySelector(job.profiles, job.proposals, job.models, args.num_gpus, config)
    batches = global_batches(job.lengths, args.tokens_per_global_batch, seed=args.seed)
    print(f"{'iter':>4}{'samples':>9}{'longest':>9}{'latency s':>11}{'homog. s':>10}  strategy")
    for it in range(args.iterations):
        ids = next(batches, None)
        if ids is None:  # the data holds fewer global batches
            break
        started = time.perf_counter()
        choice = selector.select(job.lengths[ids], ids)
        spent = time.perf_counter() - started
        homogeneous = min(
            (t for s, t in choice.estimates.items() if len(s.pipelines) == 1), default=np.nan
        )
        print(
            f"{it + 1:>4}{len(ids):>9}{int(job.lengths[ids].max()):>9}{choice.latency:>11.3f}"
            f"{homogeneous:>10.3f}  {choice.strategy}  ({len(choice.estimates)} candidates, "
            f"{spent:.2f} s)"
        )
        if args.output_dir:
            path = Path(args.output_dir) / f"iter_{it:05d}.{args.format}"
            selector.to_plan(choice).save(path, args.format)
    return 0


def _scheme_table(profiles: list[SchemeProfile]) -> str:
    lines = [
        f"{'scheme':<10}{'GPUs':>6}{'MaxLen':>9}{'UtilLen':>9}"
        f"{'T(l) = a l^2 + b l + c  (s, one stage)':>44}{'fit err':>9}"
    ]
    for p in profiles:
        a, b, c = p.coef
        lines.append(
            f"{p.scheme!s:<10}{p.scheme.num_gpus:>6}{p.max_len:>9}{p.util_len:>9}"
            f"{f'{a:.3e} l^2 + {b:.3e} l + {c:.3e}':>44}{p.fit_error:>9.1%}"
        )
    return "\n".join(lines)


def _proposal_table(proposals: list[Proposal], iw: IntervalWork) -> str:
    """One row per run of maximum lengths that share the same best strategy."""
    lines = [f"{'max length':>18}  {'est. s':>7}  best strategy (then alternatives)"]
    runs: list[list[Proposal]] = []
    for p in proposals:
        if runs and runs[-1][-1].strategies[0] == p.strategies[0]:
            runs[-1].append(p)
        else:
            runs.append([p])
    step = int(iw.upper[0])
    for run in runs:
        first, last = run[0], run[-1]
        span = f"({first.max_len - step}, {last.max_len}]"
        alternatives = "; ".join(str(s) for s in last.strategies[1:])
        lines.append(
            f"{span:>18}  {last.estimates[0]:>7.3f}  {last.strategies[0]}"
            + (f"  (then {alternatives})" if alternatives else "")
        )
    return "\n".join(lines)


def _to_json(profiles: list[SchemeProfile], proposals: list[Proposal]) -> dict:
    return {
        "schemes": [
            {
                "tp": p.scheme.tp,
                "pp": p.scheme.pp,
                "max_len": p.max_len,
                "util_len": p.util_len,
                "latency_coef": list(p.coef),
            }
            for p in profiles
        ],
        "proposals": [
            {
                "max_len": p.max_len,
                "relaxed_latency_s": p.relaxed.latency,
                "strategies": [
                    {
                        "pipelines": [
                            {"tp": s.tp, "pp": s.pp, "count": d} for s, d in st.pipelines
                        ],
                        "num_gpus": st.num_gpus,
                        "estimated_s": e,
                    }
                    for st, e in zip(p.strategies, p.estimates, strict=True)
                ],
            }
            for p in proposals
        ],
    }
