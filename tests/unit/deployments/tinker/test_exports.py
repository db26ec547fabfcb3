"""Download links of exported weights: signed by the service, refused when forged or expired, and serving only the
files of the export they name, checked against its manifest."""

import asyncio
import time

import pytest

from contracts.auth import Secret
from core.bucket.store import CheckpointStore
from deployments.tinker.exports import ExportLinks, LinkRefused


@pytest.fixture
def export(tmp_path):
    source = tmp_path / "export"
    source.mkdir()
    (source / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    (source / "adapter_config.json").write_text("{}")
    url = f"file://{tmp_path}/bucket/tinker/external"
    CheckpointStore(url, cache_dir=tmp_path / "cache").save(3, source)
    return url


def test_a_link_names_its_export_until_it_expires_and_a_forged_one_is_refused(tmp_path, export):
    links = ExportLinks(Secret("admin-token"), tmp_path / "service")
    token = links.sign(export, 3, time.time() + 60)
    assert links.check(token) == (export, 3)
    assert ExportLinks(Secret("admin-token"), tmp_path / "other").check(token) == (export, 3)  # another replica
    with pytest.raises(LinkRefused, match="not one of this service's"):
        ExportLinks(Secret("another-token"), tmp_path / "service").check(token)
    payload, mac = token.split(".")
    forged = links.sign(export, 4, time.time() + 60).split(".")[0]
    with pytest.raises(LinkRefused, match="not one of this service's"):
        links.check(f"{forged}.{mac}")
    with pytest.raises(LinkRefused, match="expired"):
        links.check(links.sign(export, 3, time.time() - 1))
    assert links.files(export, 3) == {"adapter_model.safetensors": 700, "adapter_config.json": 2}


def test_a_link_serves_the_exports_own_files_only(tmp_path, export):
    links = ExportLinks(Secret("admin-token"), tmp_path / "service")
    local = asyncio.run(links.local_file(export, 3, "adapter_model.safetensors"))
    assert local.read_bytes() == b"weights" * 100
    for outside in ("../../bucket/tinker/external/checkpoints/step-3/MANIFEST.json", ".complete", "missing.bin"):
        assert asyncio.run(links.local_file(export, 3, outside)) is None
    with pytest.raises(Exception, match="not committed"):
        asyncio.run(links.local_file(export, 9, "adapter_model.safetensors"))
    links.prune()  # fetched just now: kept
    assert local.exists()
