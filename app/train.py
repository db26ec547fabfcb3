"""Entry point of a run: `python -m app.train --config FILE [--set key=value ...]`."""

from __future__ import annotations

import argparse

from app.config import add_config_args, config_from_args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Asynchronous GRPO with LoRA on Ray.")
    add_config_args(parser)
    parser.add_argument("--address", default=None, help="Join this Ray cluster (default: start a local one).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = config_from_args(args)
    print(f"config ok: run {cfg.logging.run_name}, {cfg.grpo.max_steps} steps")


if __name__ == "__main__":
    main()
