"""The `spotrl` command: one front door to the project's entry points (`pyproject.toml` installs it).

    spotrl train|serve|tinker|plan|eval|runs [--config FILE] [--set KEY=VALUE ...] [...]

Each subcommand hands its arguments unchanged to the `main(argv)` of the module that `make` and `python -m` run, so
each command has one implementation. `spotrl COMMAND --help` prints that module's own options and then every field
of the config it reads, generated from the pydantic schema (`launch.config_help`), under the dotted keys `--set`
takes. A module is imported only when its command runs: `spotrl --help` starts nothing heavy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Protocol, cast

from pydantic import BaseModel

from core.config import FleetConfig, RunConfig
from launch.config_help import fields_help


class EntryPoint(Protocol):
    """What a command's module offers: its parser (for the help) and its main, which parses argv itself."""

    def build_parser(self) -> argparse.ArgumentParser: ...

    def main(self, argv: list[str] | None = None) -> None: ...


@dataclass(frozen=True)
class Command:
    summary: str
    module: str  # the module `make` and `python -m` run, imported on use (some import torch, Ray and vLLM)
    schema: type[BaseModel]  # the config whose fields the help lists

    def load(self) -> EntryPoint:
        return cast(EntryPoint, importlib.import_module(self.module))


COMMANDS: dict[str, Command] = {
    "train": Command(
        "train a run (as `make train`): Ray, a fleet or a shared one, learner, rollout", "launch.train", RunConfig
    ),
    "serve": Command("start a fleet on its own (as `make serve`), for runs to join", "launch.serve", FleetConfig),
    "tinker": Command("start the Tinker API beside a running fleet", "launch.tinker", FleetConfig),
    "plan": Command("bytes, sync times and cost of a run before it goes on spot", "app.plan", RunConfig),
    "eval": Command(
        "held-out accuracy of a committed version, an adapter folder or the base", "launch.evaluate", RunConfig
    ),
    "runs": Command("list, inspect and remove the runs of a shared fleet (admin token)", "launch.runs", FleetConfig),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotrl",
        description="Asynchronous GRPO with LoRA on Ray, for cheap, preemptible GPUs.",
        epilog="`spotrl COMMAND --help` lists the command's options and every field of its config.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        # No options of its own: every argument after the name goes to the command's module as it is.
        commands.add_parser(name, help=command.summary, add_help=False)
    return parser


def command_help(name: str, module: EntryPoint) -> str:
    """The module's own help, under `spotrl NAME`, followed by its config's fields."""
    parser = module.build_parser()
    parser.prog = f"spotrl {name}"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the field listing keeps its lines
    parser.epilog = fields_help(COMMANDS[name].schema)
    return parser.format_help()


def wants_help(argv: list[str]) -> bool:
    """Whether the command's arguments ask for help (before a `--`, after which they are values)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "-h" in options or "--help" in options


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = build_parser().parse_known_args(argv[:1])
    rest += argv[1:]
    module = COMMANDS[args.command].load()
    if wants_help(rest):
        print(command_help(args.command, module))
        return
    module.main(rest)


if __name__ == "__main__":
    main()
