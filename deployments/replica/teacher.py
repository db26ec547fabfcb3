"""A teacher deployment: vLLM replicas of a teacher model beside the base model's, in the same Serve app.

On-policy distillation has a teacher score the student's own samples (`prompt_logprobs`, one request per
sample, `docs/fleet-api.md`). The base model and its adapters are served by the fleet's replicas already;
a teacher model of its own (`FleetConfig.teacher`) gets replicas of its own, made like the base model's
(`VLLMReplica`, the same settings, the prefix router) but on the next cores and serving no adapter lineage.
The ingress reaches them through a handle of their own, by the teacher's model name. A teacher whose tokenizer
gives other ids than the base model's is refused here, before anything starts: it would score other tokens
than the student sampled.
"""

from __future__ import annotations

import logging
from pathlib import Path

from contracts.serving import TEACHER_DEPLOYMENT
from core.config import FleetConfig

log = logging.getLogger("ray.serve")


def teacher_app(cfg: FleetConfig, model_path: str, bucket_url: str, replica_deployment, signing_secret):
    """The teacher deployment of `cfg.teacher`, made like `replica_deployment` (the base model's), or None."""
    if cfg.teacher is None:
        return None
    from core.models import check_same_tokenizer, load_tokenizer, resolve_model_path

    teacher = cfg.teacher
    teacher_path = resolve_model_path(teacher.model)  # a tiny teacher: its folder, built and named by the entry point
    if Path(teacher_path).expanduser().exists():
        teacher_path = str(Path(teacher_path).expanduser().resolve())
    check_same_tokenizer(load_tokenizer(model_path), teacher_path, f"teacher {teacher.name!r} ({teacher_path})")
    log.info("fleet: teacher %s, %d replica(s) of %s", teacher.name, teacher.num_replicas, teacher_path)
    return replica_deployment.options(name=TEACHER_DEPLOYMENT, num_replicas=teacher.num_replicas).bind(
        teacher_path,
        teacher.name,
        cfg.teacher_fleet().model_dump(mode="json"),
        bucket_url,
        signing_secret,
        first_rank=cfg.fleet.num_replicas,  # the cores after the base model's replicas' (`deployments.replica.engine`)
        lineage=False,
    )
