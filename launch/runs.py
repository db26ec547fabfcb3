"""`spotrl runs` (`python -m launch.runs`): the runs of a shared fleet, through its admin API (docs/fleet-api.md).

    spotrl runs [list]                 the runs registered on the fleet, one name a line
    spotrl runs show NAME              one run as the fleet sees it (JSON): its bucket prefix, weight, window, rank
    spotrl runs remove NAME            forget it: its token stops working, its adapters are unloaded everywhere

The fleet is the one at `--url`, else at `fleet.host:fleet.port` of the fleet config (`--config`, `--set`); the admin
token is `SPOTRL_ADMIN_TOKEN`'s, else the config's `fleet.admin_token` (a fleet without one takes any caller as its
admin). A run's own token (`SPOTRL_RUN_TOKEN`) may list and show that run alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from app.fleet_client import FleetClient, FleetError
from app.fleet_run import RUN_TOKEN_ENV
from contracts.auth import TokenError, admin_token
from core.config import config_errors_exit, load_fleet_config

ACTIONS = ("list", "show", "remove")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=ACTIONS, default="list", help="What to do (default: list).")
    parser.add_argument("name", nargs="?", default=None, help="The run to show or remove.")
    parser.add_argument("--config", default=None, help="The fleet's config file (default: the tiny CPU fleet).")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="Override a field."
    )
    parser.add_argument("--url", default=None, help="The fleet's URL (default: http://fleet.host:fleet.port).")
    return parser


def act(fleet: FleetClient, action: str, name: str | None) -> str:
    """Do `action` on the fleet; what to print."""
    if action == "list":
        return "\n".join(fleet.list_runs())
    if action == "show":
        return json.dumps(fleet.run_info(name), indent=1)
    fleet.remove_run(name)
    return f"run {name} removed: its token no longer works, its adapters are unloaded"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.action != "list" and not args.name:
        parser.error(f"{args.action} needs the run's NAME")
    with config_errors_exit(TokenError):
        cfg = load_fleet_config(args.config, args.overrides)
        token = admin_token(cfg) or os.environ.get(RUN_TOKEN_ENV) or None
    url = args.url or f"http://{cfg.fleet.host}:{cfg.fleet.port}"
    with contextlib.closing(FleetClient(url, token=token, timeout_s=30.0)) as fleet:
        try:
            output = act(fleet, args.action, args.name)
        except FleetError as e:  # a wrong token, an unknown run, no fleet there: one line
            print(f"runs: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    if output:
        print(output)


if __name__ == "__main__":
    main()
