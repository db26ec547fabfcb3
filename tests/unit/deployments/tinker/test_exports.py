"""Download links of exported weights: signed by the service, refused when forged or expired, good only while the
owner's record still names their export (and, for another key's link, still publishes it), and serving only the files
of the export they name, checked against its manifest."""

import asyncio
import time

import pytest

from contracts.auth import Secret
from core.bucket import tinker_paths
from core.bucket.store import CheckpointStore
from deployments.tinker.exports import ExportLinks, Link, LinkGone, LinkRefused

PREFIX_OF = "file://{}/bucket/runs/alice"
PATH = "tinker://m/external_weights/out"


@pytest.fixture
def export(tmp_path):
    source = tmp_path / "export"
    source.mkdir()
    (source / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    (source / "adapter_config.json").write_text("{}")
    link = Link(PREFIX_OF.format(tmp_path), PATH, 3, owner=True, holder="alice")
    CheckpointStore(link.store_url, cache_dir=tmp_path / "cache").save(3, source)
    return link.store_url


def test_a_link_names_its_export_until_it_expires_and_a_forged_one_is_refused(tmp_path, export):
    links = ExportLinks(Secret("admin-token"), tmp_path / "service")
    link = Link(PREFIX_OF.format(tmp_path), PATH, 3, owner=False, holder="bob")
    token = links.sign(link, time.time() + 60)
    assert links.check(token) == link and link.store_url == export
    assert ExportLinks(Secret("admin-token"), tmp_path / "other").check(token) == link  # another replica
    with pytest.raises(LinkRefused, match="not one of this service's"):
        ExportLinks(Secret("another-token"), tmp_path / "service").check(token)
    payload, mac = token.split(".")
    forged = links.sign(Link(link.prefix, PATH, 4, owner=True, holder=link.holder), time.time() + 60).split(".")[0]
    with pytest.raises(LinkRefused, match="not one of this service's"):
        links.check(f"{forged}.{mac}")
    with pytest.raises(LinkRefused, match="expired"):
        links.check(links.sign(link, time.time() - 1))
    assert links.files(export, 3) == {"adapter_model.safetensors": 700, "adapter_config.json": 2}


def test_a_link_works_only_while_the_owners_record_names_its_export(tmp_path, export):
    """The signature says what a link was given for; the record, read at each download, says whether it still is:
    another key's link ends when the owner unpublishes, every link when the export is deleted or its name saved
    again, and a link never reaches the export that took a later number."""
    prefix = PREFIX_OF.format(tmp_path)
    owners, others = Link(prefix, PATH, 3, owner=True, holder="alice"), Link(prefix, PATH, 3, owner=False, holder="bob")
    for link in (owners, others):
        with pytest.raises(LinkGone, match="deleted"):  # nothing recorded under the path
            ExportLinks.still_there(link)
    tinker_paths.remember(prefix, PATH, "external", 3, public=True)
    ExportLinks.still_there(owners), ExportLinks.still_there(others)
    tinker_paths.remember(prefix, PATH, "external", 3, public=False)  # unpublished
    ExportLinks.still_there(owners)
    with pytest.raises(LinkGone, match="no longer published"):
        ExportLinks.still_there(others)
    tinker_paths.remember(prefix, PATH, "external", 4, public=True)  # the name exported again: another number
    for link in (owners, others):
        with pytest.raises(LinkGone, match="replaced"):
            ExportLinks.still_there(link)
    tinker_paths.remember(prefix, PATH, "training", 3)  # a record of another kind never serves a download
    with pytest.raises(LinkGone):
        ExportLinks.still_there(owners)
    tinker_paths.paths(prefix).delete(tinker_paths.record_name(PATH))
    with pytest.raises(LinkGone):
        ExportLinks.still_there(owners)


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
