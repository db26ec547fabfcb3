"""`spotrl eval` (`python -m launch.evaluate`): the held-out accuracy of a committed version, of an adapter folder or
of the base model, measured as the driver measures it before and after a run (`app.evaluate.evaluate`, on a fleet).

    spotrl eval [--config FILE] [--set KEY=VALUE ...] [policy-vN | ADAPTER_FOLDER] [--url URL | --address ADDR]

Without `--url` it does what the driver does (`launch.train.start_fleet`): starts a loopback Ray (or joins
`--address`), brings the run's fleet up (or uses the one running there), has it serve the version, evaluates, and
stops what it started. A version (`policy-vN`, or N) is one committed to the run's bucket (`bucket.url`); without one,
the newest, else the base model. An adapter folder (PEFT's adapter_config.json and weights, e.g. what `tinker
checkpoint download` unpacks) is published as version 1 of a scratch bucket on this machine, which a fleet of its own
serves: the run's bucket is never written. With `--url` it evaluates on that running fleet. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from app.evaluate import EvaluationLost, base_model_name, evaluate
from app.fleet_client import FleetClient, FleetError
from app.tasks.checks import check_names
from app.weight_sync import ensure_served
from contracts.adapters import adapter_name
from contracts.auth import admin_token, inference_token
from core.bucket.filesystem import BucketError
from core.bucket.store import AdapterStore
from core.config import ConfigError, RunConfig, add_config_args, config_from_args
from core.models import pin_revision
from launch.train import start_fleet
from tiny.build import prepare_run

log = logging.getLogger("spotrl.eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument(
        "adapter",
        nargs="?",
        default=None,
        help="policy-vN (or N) of the run's bucket, or a PEFT adapter folder (default: the newest version, else the base).",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="Evaluate on the fleet running at URL (default: start one).")
    where.add_argument("--address", default=None, help="Join this Ray cluster (default: start a local one).")
    return parser


def adapter_folder(ref: str | None) -> Path | None:
    """`ref` as a PEFT adapter folder, or None when it names a version (or nothing)."""
    path = Path(ref) if ref else None
    return path if path is not None and (path / "adapter_config.json").is_file() else None


def committed_version(store: AdapterStore, ref: str | None) -> int | None:
    """The version `ref` names (`policy-v3`, `3`, `adapters/policy-v3` or its URL), checked committed; without a ref,
    the newest, or None when the bucket holds none (the base model is evaluated)."""
    if ref is None:
        return store.latest()
    version = int(ref) if ref.isdigit() else store.resolve(ref)
    if version not in store.versions():
        raise BucketError(f"{store.key_of(version)} is not a committed version of {store.url}")
    return version


def in_scratch_bucket(stack: ExitStack, cfg: RunConfig) -> RunConfig:
    """`cfg` with a bucket (and cache) of its own in a folder removed when `stack` closes."""
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spotrl-eval-")))
    bucket = cfg.bucket.model_copy(update={"url": f"file://{folder}/bucket", "cache_dir": str(folder / "cache")})
    return cfg.model_copy(update={"bucket": bucket})


def held_out(cfg: RunConfig, ref: str | None, url: str | None = None, address: str | None = None) -> dict:
    """Evaluate what `ref` names (see the module's docstring) on the fleet at `url`, or on one started as the driver
    starts it; returns `app.evaluate.evaluate`'s result."""
    folder = adapter_folder(ref)
    if folder is not None and url:
        raise ConfigError("an adapter folder is evaluated on a fleet of its own: leave out --url")
    with ExitStack() as stack:
        if folder is not None:
            cfg = in_scratch_bucket(stack, cfg)
        version = None if folder is not None else committed_version(AdapterStore.from_config(cfg), ref)
        model_path = prepare_run(cfg, log=log.info)
        pin_revision(cfg.model, model_path, log=log.info)
        if url:
            fleet = FleetClient(url, token=admin_token(cfg))
        else:
            fleet = start_fleet(stack, cfg, model_path, address)
        stack.callback(fleet.close)
        if folder is not None:  # signed for the fleet's own lineage, which is all the scratch bucket holds
            AdapterStore.from_config(cfg, fleet.signing_key()).publish(folder, 1)
            version = 1
        if version is None:
            model = base_model_name(fleet)
        else:
            ensure_served(fleet, cfg, version)
            model = adapter_name(version, cfg.fleet_run)
        result = evaluate(cfg, fleet.base_url, model_path, model, inference_token(cfg))
        log.info("held-out accuracy of %s: %.3f", ref or model, result["accuracy"])
        return result


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args, checks=(check_names,))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        result = held_out(cfg, args.adapter, args.url, args.address)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (BucketError, FleetError, EvaluationLost) as e:  # nothing to evaluate, or no fleet to do it: one line
        print(f"eval: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
