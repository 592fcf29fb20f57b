"""One vocabulary (#35): each concept has one flag name in every command, Megatron's where
Megatron has the concept; a spelling used before is refused with exit status 2 and one line
naming its replacement; every command plans for the same default GPU; `--help` is grouped."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from dynapipe_planner import cli
from dynapipe_planner.cluster import DEFAULT_GPU
from dynapipe_planner.hetero import cli as hetero_cli
from dynapipe_planner.search import cli as search_cli
from dynapipe_planner.strategy import cli as strategy_cli

MAINS = {
    "dynapipe-plan": cli.plan_main,
    "dynapipe-simulate": cli.simulate_main,
    "dynapipe-strategy": strategy_cli.strategy_main,
    "dynapipe-search": search_cli.search_main,
    "dynapipe-hetero": hetero_cli.hetero_main,
}
PARSERS = {
    "dynapipe-plan": cli._plan_parser,
    "dynapipe-simulate": cli._simulate_parser,
    "dynapipe-strategy": strategy_cli._parser,
    "dynapipe-search": search_cli._parser,
    "dynapipe-hetero": hetero_cli._parser,
}
# Written out here rather than read from the modules' tables, so that dropping a refusal fails.
RENAMED = [
    ("dynapipe-plan", [], "--global-batch-tokens", "--tokens-per-global-batch"),
    ("dynapipe-plan", [], "--max-seqlen", "--seq-length"),
    ("dynapipe-plan", [], "--tp", "--tensor-model-parallel-size"),
    ("dynapipe-plan", [], "--pp", "--pipeline-model-parallel-size"),
    ("dynapipe-plan", [], "--dp", "--num-gpus (GPUs: TP x PP x data-parallel replicas)"),
    ("dynapipe-plan", [], "--memory-limit-gb", "--memory-limit-gib"),
    ("dynapipe-plan", [], "--schedule", "--pipeline-schedule"),
    ("dynapipe-strategy", ["propose"], "--tokens-per-iteration", "--tokens-per-global-batch"),
    ("dynapipe-strategy", ["plan"], "--context-length", "--seq-length"),
    ("dynapipe-strategy", ["propose"], "--memory-limit-gb", "--memory-limit-gib"),
    ("dynapipe-search", [], "--memory-budget-gb", "--memory-limit-gib"),
    ("dynapipe-search", [], "--pp", "--pipeline-model-parallel-size"),
    ("dynapipe-search", [], "--tgt-seq-length", "--decoder-seq-length"),
    ("dynapipe-hetero", [], "--seqlen", "--seq-length"),
    ("dynapipe-hetero", [], "--global-batch", "--global-batch-size"),
]
# Concepts the commands share -> the one name each command that has the concept uses.
SHARED = {
    "--seq-length": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-search", "dynapipe-hetero"),
    "--tokens-per-global-batch": ("dynapipe-plan", "dynapipe-strategy"),
    "--global-batch-size": ("dynapipe-search", "dynapipe-hetero"),
    "--micro-batch-size": ("dynapipe-plan", "dynapipe-hetero"),
    "--memory-limit-gib": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-search"),
    "--gpu": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-search"),
    "--num-gpus": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-search"),
    "--gpus-per-node": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-search"),
    "--pipeline-model-parallel-size": ("dynapipe-plan", "dynapipe-search"),
    "--max-tp": ("dynapipe-strategy", "dynapipe-search"),
    "--model": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-search", "dynapipe-hetero"),
    "--recompute": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-hetero"),
    "--seed": ("dynapipe-plan", "dynapipe-strategy", "dynapipe-hetero"),
}


def _run(main, argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The flags a parser (or, for `dynapipe-strategy`, its subcommands) takes and shows."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
        elif action.help is not argparse.SUPPRESS:
            found |= set(action.option_strings)
    return found


@pytest.mark.parametrize(("prog", "command", "old", "new"), RENAMED)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_an_old_spelling_is_refused_naming_its_replacement(prog, command, old, new, form):
    argv = [*command, old, "2"] if form == "separate" else [*command, f"{old}=2"]
    code, err = _run(MAINS[prog], argv)
    assert code == 2
    assert err == f"{prog}: error: {old} was renamed {new}\n"


@pytest.mark.parametrize(("prog", "command", "old", "new"), RENAMED)
def test_the_replacement_is_taken(prog, command, old, new):
    parser = PARSERS[prog]()
    new_flag = new.split()[0]
    assert new_flag in _options(parser)
    assert old not in _options(parser)  # hidden from --help


@pytest.mark.parametrize(("flag", "progs"), SHARED.items())
def test_a_shared_concept_has_one_name(flag, progs):
    for prog in progs:
        assert flag in _options(PARSERS[prog]()), (prog, flag)


def test_no_command_takes_an_abbreviation():
    code, err = _run(cli.plan_main, ["--seq", "10"])
    assert code == 2 and err == "dynapipe-plan: error: unrecognized arguments: --seq 10\n"
    code, err = _run(hetero_cli.hetero_main, ["--cluster", "x.yaml", "--global-batch-s", "8"])
    assert code == 2 and "unrecognized arguments: --global-batch-s" in err


def test_every_command_plans_for_the_same_default_gpu():
    assert DEFAULT_GPU == "A100-80GB"
    assert cli._plan_parser().parse_args([]).gpu == DEFAULT_GPU
    assert strategy_cli._parser().parse_args(["plan"]).gpu == DEFAULT_GPU
    assert search_cli._parser().parse_args([]).gpu == DEFAULT_GPU


def test_pretrain_gpt_gpu_default_is_the_same():
    pytest.importorskip("megatron.training")
    from megatron.dynapipe.arguments import add_dynapipe_args

    parser = add_dynapipe_args(argparse.ArgumentParser())
    assert parser.get_default("dynapipe_gpu") == DEFAULT_GPU


@pytest.mark.parametrize("prog", PARSERS)
def test_help_is_grouped(prog):
    """Like Megatron's `--help`: every flag sits in a titled group; only `-h` and `--debug`
    stay among the ungrouped options."""
    parsers = [PARSERS[prog]()]
    for action in parsers[0]._actions:
        if isinstance(action, argparse._SubParsersAction):  # the commands' own parsers
            parsers = list(action.choices.values())
    for parser in parsers:
        titles = [g.title for g in parser._action_groups if g._group_actions]
        assert "output" in titles, (parser.prog, titles)
        for group in parser._action_groups:
            if group.title != "options":
                continue
            shown = {
                option
                for action in group._group_actions
                if action.help is not argparse.SUPPRESS
                and not isinstance(action, argparse._SubParsersAction)
                for option in action.option_strings
            }
            assert shown <= {"-h", "--help", "--debug"}, (parser.prog, shown)


def test_plan_data_parallel_replicas_come_from_num_gpus():
    code, err = _run(cli.plan_main, ["--num-gpus", "6", "--pipeline-model-parallel-size", "4"])
    assert code == 2
    assert err == (
        "dynapipe-plan: error: argument --num-gpus: 6 GPUs are not a multiple of TP x PP = 1 x 4\n"
    )


def test_search_budget_defaults_to_the_gpus_memory_but_not_with_cost_tables(tmp_path, capsys):
    argv = ["--model", "gpt-125m", "--num-gpus", "4", "--seq-length", "512"]
    assert search_cli.search_main([*argv, "--global-batch-size", "32", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB (8 per node)" in out and "budget 72.00 GiB per GPU" in out  # 80 - 10%
    code, err = _run(search_cli.search_main, ["--cost-table", str(tmp_path / "t.json")])
    assert code == 2
    assert err.startswith("dynapipe-search: error: argument --memory-limit-gib: give the budget")
