"""Recipe: an endpoint of your own on the fleet's HTTP API, named in `fleet.routes`.

    .venv/bin/python -m examples.route_tokenize                     # a fleet of the tiny model with the route, asked once
    .venv/bin/python -m examples.route_tokenize keep_serving=true   # ... and kept up until Ctrl-C
    spotrl serve --set 'fleet.routes=[examples.route_tokenize:tokenize_routes]'     # on any fleet

The fleet's API is classes of routes, one per job (`deployments/api/`): each method marked with `@route(verb, path)`
answers that call, and what its handlers share (the callers, the backend, the fair share, ...) is the class's.
`fleet.routes` names callables that make one such class from the app's `RouteParts`; the ingress adds their routes
beside the shipped ones (never in their place: a taken path fails the fleet's start). This one counts a text's tokens
as the fleet's tokenizer does, so a client can size a prompt before sending it; the caller is checked as every
inference call is (`fleet.protect_inference`), and the tokenizing runs off the event loop that answers everyone.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from deployments.api.bodies import RequestLimits
from deployments.api.intake import read_json
from deployments.api.routing import Routes, route
from deployments.api.server import RouteParts
from deployments.control.offload import offload


class Config(BaseModel):
    """The recipe's knobs; anything else of the fleet's config is a `sets` override (`--set` of `spotrl serve`)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field("configs/fleet-tiny-cpu.yaml", description="The fleet's YAML to start from.")
    text: str = Field("Compute 12+34. Answer: ", description="What the recipe asks the new endpoint to tokenize.")
    keep_serving: bool = Field(False, description="Keep the fleet up after the question, until Ctrl-C.")
    sets: list[str] = Field(default_factory=list, description="More KEY=VALUE overrides of the fleet's config.")


class TokenizeBody(BaseModel):
    """`POST /v1/tokenize`'s body: the text, nothing else (an unknown field is a 400, as everywhere)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="Text to tokenize as the fleet's prompts are.")


class TokenizeRoutes(Routes):
    def __init__(self, parts: RouteParts):
        self.settings, self.callers = parts.settings, parts.callers

    @route("POST", "/v1/tokenize")
    async def tokenize(self, request: Request) -> dict[str, Any]:
        self.callers.authorize(request)  # an inference call: open unless fleet.protect_inference
        limits: RequestLimits = self.settings.limits
        body = await read_json(request, TokenizeBody, limits)  # 413 past max_request_bytes, 400 if malformed
        limits.check_text([body.text])
        ids = await offload(self.settings.encode, body.text)  # CPU work: never on the event loop
        return {"tokens": ids, "count": len(ids), "max_model_len": self.settings.max_model_len}


def tokenize_routes(parts: RouteParts) -> Routes:
    """What `fleet.routes` names: the routes made from the app's parts."""
    return TokenizeRoutes(parts)


def fleet_sets(config: Config) -> list[str]:
    """The fleet's overrides: the route named, then the recipe's."""
    return [f"fleet.routes=[{__name__}:tokenize_routes]", *config.sets]


def parse(argv: list[str]) -> Config:
    """`key=value` arguments (values read as YAML, as `--set` reads them) into the recipe's Config."""
    pairs = [a.split("=", 1) for a in argv]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"expected key=value arguments, the fields of Config: {', '.join(Config.model_fields)}")
    return Config.model_validate({k: yaml.safe_load(v) for k, v in pairs})


def main(argv: list[str] | None = None) -> None:
    """A fleet with the route on a loopback Ray of its own (as `spotrl serve` starts one), asked once; then down."""
    import httpx
    import ray

    from core.config import load_fleet_config
    from core.local_ray import start_ray
    from deployments.fleet import deploy_fleet, shutdown_fleet
    from tiny.build import prepare_model

    config = parse(sys.argv[1:] if argv is None else argv)
    cfg = load_fleet_config(config.base, fleet_sets(config))
    model_path = prepare_model(cfg.model, log=print)  # the tiny model's folder, built once and cached
    start_ray(None, offline=True)
    try:
        url = deploy_fleet(cfg, model_path)
        answer = httpx.post(f"{url}/v1/tokenize", json={"text": config.text}, timeout=60).json()
        print(json.dumps({"url": url, "text": config.text, **answer}))
        if config.keep_serving:
            input("serving; Enter or Ctrl-C stops it\n")
    except KeyboardInterrupt:
        pass
    finally:
        shutdown_fleet(cfg)
        ray.shutdown()


if __name__ == "__main__":
    from examples.route_tokenize import main as recipe_main  # by its module name: Ray's workers import it so

    recipe_main()
