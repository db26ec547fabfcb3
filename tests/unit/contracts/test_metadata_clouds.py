"""Whose metadata service a node watches (`spot.metadata`), judged without network: over fake DMI folders."""

from __future__ import annotations

import pytest

from contracts.notice_sources import (
    AWS,
    GCP,
    AwsMetadata,
    GcpMetadata,
    detected_clouds,
    metadata_clouds,
    watched_sources,
)
from core.config import SpotConfig


def dmi(tmp_path, **files: str):
    """A fake `/sys/class/dmi/id` holding `files` (name -> content, as the kernel writes them: a line each)."""
    folder = tmp_path / "dmi"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text + "\n")
    return folder


@pytest.mark.parametrize(
    "files, clouds",
    [
        ({"sys_vendor": "Amazon EC2", "product_name": "m7i.large", "bios_vendor": "Amazon EC2"}, {AWS}),  # Nitro
        ({"sys_vendor": "Xen", "product_name": "HVM domU", "bios_version": "4.11.amazon"}, {AWS}),  # older Xen
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine", "bios_vendor": "Google"}, {GCP}),
        ({"sys_vendor": "LENOVO", "product_name": "21CB", "bios_vendor": "LENOVO"}, set()),  # a laptop
        ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, set()),  # a local VM
        ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, set()),  # Azure: not watched
    ],
)
def test_the_firmware_names_the_cloud(tmp_path, files, clouds):
    assert detected_clouds({}, dmi(tmp_path, **files)) == clouds


def test_without_dmi_and_without_the_sdks_variables_no_cloud_is_detected(tmp_path):
    """A container that hides /sys, a machine without DMI (this CI box): nothing to read is no cloud."""
    assert detected_clouds({}, tmp_path / "absent") == set()


def test_the_sdks_endpoint_variables_name_their_cloud(tmp_path):
    absent = tmp_path / "absent"
    assert detected_clouds({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9"}, absent) == {AWS}
    assert detected_clouds({"GCE_METADATA_HOST": "127.0.0.1:9"}, absent) == {GCP}
    assert detected_clouds({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "", "GCE_METADATA_HOST": ""}, absent) == set()


def test_on_and_off_decide_and_auto_watches_both_clouds_on_a_joined_cluster():
    laptop: dict[str, str] = {}
    assert metadata_clouds("off", joined=True, environ={"GCE_METADATA_HOST": "127.0.0.1:9"}) == set()
    assert metadata_clouds("on", joined=False, environ=laptop) == {AWS, GCP}
    assert metadata_clouds("auto", joined=True, environ=laptop) == {AWS, GCP}
    assert metadata_clouds("auto", joined=False, environ={"GCE_METADATA_HOST": "127.0.0.1:9"}) == {GCP}


def test_the_default_watches_no_metadata_service_on_a_machine_that_is_no_cloud_instance(monkeypatch, tmp_path):
    """The embedded default on a laptop: no source at all, so nothing is ever sent to 169.254.169.254."""
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", raising=False)
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    monkeypatch.setattr("contracts.notice_sources.DMI_DIR", tmp_path / "absent")
    assert SpotConfig().metadata == "auto"
    assert watched_sources(SpotConfig(), joined=False) == []
    kinds = [type(s) for s in watched_sources(SpotConfig(metadata="on"), joined=False)]
    assert kinds == [AwsMetadata, GcpMetadata]
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # botocore's own switch still turns AWS off
    assert [type(s) for s in watched_sources(SpotConfig(metadata="on"), joined=False)] == [GcpMetadata]
