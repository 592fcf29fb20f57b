"""What the real-run scripts (`examples/runs/*.sh`) ask the planner before they launch
`torchrun pretrain_gpt.py`; each subcommand prints what the shell reads:

    model-flags MODEL                      pretrain_gpt.py's flags for a preset or ModelSpec JSON
    search-flags PLAN                      the pretrain_gpt.py flags of a `dynapipe-search
                                           --output` plan; exit 3 with the reasons it cannot run
    emulated-cluster GPU SLOWDOWNS OUTPUT  a `dynapipe-hetero --cluster` YAML of one host whose
                                           rank r is GPU with its compute (FLOPS and memory
                                           bandwidth) SLOWDOWNS[r] times slower, as the runtime's
                                           `devices.emulated_cluster` sees `--device-speed`
    by-rank PLAN VALUES                    VALUES (one per device) reordered for the ranks of a
                                           `dynapipe-hetero --bind-ranks` plan: rank r gets its
                                           device's value (its slowdown, or its GPU index)

SLOWDOWNS and VALUES are comma lists, one item per device (`--device-speed`'s bare form).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import yaml

from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.devices import GB
from dynapipe_planner.megatron_model import model_flags
from dynapipe_planner.model_spec import load_model_spec

NOT_RUNNABLE = 3


def _slowdowns(text: str) -> list[float]:
    return [float(f) for f in text.split(",")]


def print_model_flags(args: argparse.Namespace) -> None:
    flags = model_flags(load_model_spec(args.model))
    # The runtime sizes learned position embeddings to --seq-length, which the grids vary.
    at = flags.index("--max-position-embeddings")
    print(" ".join(flags[:at] + flags[at + 2 :]))


def print_search_flags(args: argparse.Namespace) -> None:
    runtime = json.loads(Path(args.plan).read_text())["runtime"]
    if not runtime["expressible"]:
        print("; ".join(runtime["notes"]))
        raise SystemExit(NOT_RUNNABLE)
    print(" ".join(runtime["flags"]))


def write_emulated_cluster(args: argparse.Namespace) -> None:
    """One machine per rank so that every rank can have its own speed; the links between them
    are the GPU's intra-node ones, since the ranks share one host."""
    gpu = get_gpu(args.gpu)
    cluster = {
        "name": f"{args.gpu} x {args.slowdowns}",
        "network": {
            "bandwidth_gbs": gpu.intra_node_bandwidth / GB,
            "latency_us": gpu.link_latency_s * 1e6,
        },
        "machines": [
            {
                "name": f"rank{rank}-x{factor:g}",
                "gpu": args.gpu,
                "count": 1,
                "peak_tflops": gpu.peak_flops / factor / 1e12,
                "hbm_bandwidth_gbs": gpu.hbm_bandwidth / factor / GB,
            }
            for rank, factor in enumerate(_slowdowns(args.slowdowns))
        ],
    }
    Path(args.output).write_text(yaml.safe_dump(cluster, sort_keys=False))


def print_by_rank(args: argparse.Namespace) -> None:
    device_of_rank = json.loads(Path(args.plan).read_text())["stats"]["device_of_rank"]
    values = args.values.split(",")
    print(",".join(values[device] for device in device_of_rank))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("model-flags")
    p.add_argument("model")
    p.set_defaults(func=print_model_flags)
    p = commands.add_parser("search-flags")
    p.add_argument("plan")
    p.set_defaults(func=print_search_flags)
    p = commands.add_parser("emulated-cluster")
    p.add_argument("gpu")
    p.add_argument("slowdowns")
    p.add_argument("output")
    p.set_defaults(func=write_emulated_cluster)
    p = commands.add_parser("by-rank")
    p.add_argument("plan")
    p.add_argument("values")
    p.set_defaults(func=print_by_rank)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
