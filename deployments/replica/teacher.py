"""Model deployments: vLLM replicas of a teacher model or a judge model beside the base model's, in the same Serve app.

On-policy distillation has a teacher score the student's own samples (`prompt_logprobs`, one request per
sample, `docs/fleet-api.md`); a judge reads them and says how good they are (`docs/judges.md`). The base model and
its adapters are served by the fleet's replicas already; a model of its own (`FleetConfig.teacher`,
`FleetConfig.judge`) gets replicas of its own, made like the base model's (`VLLMReplica`, the same settings, the
prefix router) but on the next cores and serving no adapter lineage: one builder for either, told which field it
serves. The ingress reaches each through a handle of its own, by the model name requests give it. A model whose
tokenizer gives other ids than the base model's is refused here, before anything starts: it would score other
tokens than the student sampled, and the ingress, which tokenizes every text prompt with the base model's
tokenizer, would show it other text than was asked.
"""

from __future__ import annotations

import logging
from pathlib import Path

from contracts.serving import TEACHER_DEPLOYMENT
from core.config import FleetConfig

log = logging.getLogger("ray.serve")

JUDGE_DEPLOYMENT = "JudgeReplica"
# Each deployment's Serve name, by the `FleetConfig` field that configures it.
SERVE_NAMES = {"teacher": TEACHER_DEPLOYMENT, "judge": JUDGE_DEPLOYMENT}


def deployment_apps(cfg: FleetConfig, model_path: str, bucket_url: str, replica_deployment, signing_secret) -> dict:
    """Each model deployment of `cfg` (`FleetConfig.deployments`), made like `replica_deployment` (the base model's),
    by the model name requests give it: what the ingress routes a request to by its `model`. Their replicas pin the
    cores after the base model's, one deployment's after another's (`deployments.replica.engine`)."""
    apps = {}
    first_rank = cfg.fleet.num_replicas
    for field, deployment in cfg.deployments().items():
        name, app = deployment_app(cfg, field, model_path, bucket_url, replica_deployment, signing_secret, first_rank)
        apps[name] = app
        first_rank += deployment.num_replicas
    return apps


def deployment_app(
    cfg: FleetConfig, field: str, model_path: str, bucket_url: str, replica_deployment, signing_secret, first_rank: int
):
    """The deployment `field` (`teacher`, `judge`) of `cfg`, its replicas' cores from `first_rank` on: its model
    name and its Serve application."""
    from core.models import check_same_tokenizer, load_tokenizer, resolve_model_path

    deployment = cfg.deployments()[field]
    path = resolve_model_path(deployment.model)  # a tiny model: its folder, built and named by the entry point
    if Path(path).expanduser().exists():
        path = str(Path(path).expanduser().resolve())
    check_same_tokenizer(load_tokenizer(model_path), path, f"{field} {deployment.name!r} ({path})")
    log.info("fleet: %s %s, %d replica(s) of %s", field, deployment.name, deployment.num_replicas, path)
    app = replica_deployment.options(name=SERVE_NAMES[field], num_replicas=deployment.num_replicas).bind(
        path,
        deployment.name,
        cfg.deployment_fleet(field).model_dump(mode="json"),
        bucket_url,
        signing_secret,
        first_rank=first_rank,
        lineage=False,
    )
    return deployment.name, app
