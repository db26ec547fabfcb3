"""`python -m app.evaluate` without --adapter: the newest version in the bucket, else the base model as served."""

import httpx

from app.bucket.store import AdapterStore
from app.config import load_config
from app.evaluate import default_model
from app.fleet_client import FleetClient


def _fleet(base_name: str, adapters: list[str]) -> FleetClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        data = [{"id": base_name, "parent": None}, *({"id": a, "parent": base_name} for a in adapters)]
        return httpx.Response(200, json={"object": "list", "data": data})

    return FleetClient("http://fleet.test", transport=httpx.MockTransport(handler))


def test_without_a_version_the_base_model_is_evaluated_under_the_name_the_fleet_serves(tmp_path):
    cfg = load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache"])
    served_as = "/models/tiny-qwen2"  # the fleet serves the base under its resolved folder
    assert default_model(cfg, _fleet(served_as, [])) == served_as

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 1}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    AdapterStore.from_config(cfg).publish(adapter, 3)
    assert default_model(cfg, _fleet(served_as, ["policy-v3"])) == "policy-v3"
