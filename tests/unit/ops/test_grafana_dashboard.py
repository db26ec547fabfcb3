"""The Grafana dashboard parses and only charts metrics that our code (or vLLM's Ray logger) exports."""

import json
import re

from tests.support import REPO

DASHBOARD = REPO / "ops" / "grafana" / "spotrl_dashboard.json"


def test_dashboard_covers_the_run_and_names_real_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"ray_([a-z0-9_]+?)\(_total\)", e)}
    histograms = {n for e in exprs for n in re.findall(r"ray_([a-z0-9_]+?)_bucket", e)}
    assert len(names) >= 15, names
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "reward",
        "step time",
        "staleness",
        "queue",
        "in-flight",
        "affinity",
        "prefix-cache",
        "weight sync",
        "per run",
    ):
        assert topic in titles, topic

    from app.metrics_sink import prometheus_name

    driver_metrics = {
        prometheus_name(k)
        for k in (
            "reward",
            "perf/step_s",
            "perf/fwd_bwd_s",
            "perf/rollout_wait_s",
            "sample/staleness_mean",
            "sample/staleness_max",
            "sample/rollout_queue_size",
            "rollout/inflight",
            "ratio",
            "clip_ratio/region_mean",
            "perf/weight_sync_s",
            "rollout/generated_tok_s",
            "perf/mfu_fwd_bwd",
        )
    }
    router_source = (REPO / "deployments" / "routing" / "router.py").read_text()
    fair_share_source = (REPO / "deployments" / "control" / "run_metrics.py").read_text()
    per_run = {n for n in names | histograms if n.startswith("spotrl_fleet_run_")}
    for metric in (
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "queue_wait_s",
        "in_flight",
        "queued",
        "slots_held",
    ):
        assert f"spotrl_fleet_run_{metric}" in per_run, metric  # every per-run metric is charted
    for name in names | histograms:
        if name.startswith("spotrl_fleet_run_"):
            assert f'"{name}"' in fair_share_source, name
        elif name.startswith("spotrl_router_"):
            assert name.removeprefix("spotrl_router_") in router_source, name
        elif name.startswith("spotrl_"):
            assert name in driver_metrics, name
        else:
            assert name.startswith("vllm_"), name  # vLLM's RayPrometheusStatLogger: vllm:x -> vllm_x
