"""The GPU dependency set installs: pip's resolver in dry-run mode on the `gpu` extra with `envs`, `tinker` and
`trackers`; and so does the OpenEnv venv's requirement (`requirements-openenv.txt`, resolved by itself: openenv's
mcp<2 cannot share a resolution with vLLM's mcp>=2, which is why it has a venv of its own).

Nothing is downloaded but metadata, and nothing is installed. It runs on CPU machines (CI) so that a
pin that cannot be resolved (vllm requiring another torch than the one we pin, a Python range that
a dependency refuses) fails `make test` here instead of `make setup DEVICE=gpu` on a GPU node.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def resolve(report: Path, *what: str) -> dict[str, str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--report", str(report), *what]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        if "NewConnectionError" in done.stderr or "Temporary failure in name resolution" in done.stderr:
            pytest.skip("no package index reachable from this machine")
        errors = [line for line in done.stderr.splitlines() if not line.startswith("WARNING: Location")]
        pytest.fail("pip could not resolve the set:\n" + "\n".join(errors[-15:]))
    return {p["metadata"]["name"].lower(): p["metadata"]["version"] for p in json.loads(report.read_text())["install"]}


# The GPU machine installs the environment libraries, the Tinker SDK and the trackers beside vllm: they must resolve
# together.
GPU_SET = "gpu,envs,tinker,trackers"
PYTHON_3_12 = ("--python-version", "3.12", "--only-binary=:all:")


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """The resolutions at once: each waits on the index more than on the CPU."""
    tmp = tmp_path_factory.mktemp("resolve")
    with ThreadPoolExecutor(3) as pool:
        yield {
            "here": pool.submit(resolve, tmp / "here.json", f"{REPO}[{GPU_SET}]"),
            "3.12": pool.submit(resolve, tmp / "py312.json", *PYTHON_3_12, f"{REPO}[{GPU_SET}]"),
            "openenv": pool.submit(resolve, tmp / "openenv.json", "-r", str(REPO / "requirements-openenv.txt")),
        }


@pytest.mark.slow
def test_gpu_extra_resolves_with_the_pinned_torch(resolutions):
    versions = resolutions["here"].result()
    assert versions["vllm"].startswith("0.32.")
    assert versions["torch"].split("+")[0] == "2.13.0"


@pytest.mark.slow
def test_gpu_extra_resolves_for_python_3_12_wheels(resolutions):
    """Common GPU images ship Python 3.12: every dependency must have a 3.12 wheel at our pins."""
    versions = resolutions["3.12"].result()
    assert versions["torch"].split("+")[0] == "2.13.0"


@pytest.mark.slow
def test_the_openenv_venvs_requirement_resolves_by_itself_without_torch(resolutions):
    """What `make setup` installs into `.venv-openenv`: the pinned openenv, with the mcp<2 that keeps it apart."""
    versions = resolutions["openenv"].result()
    assert versions["openenv"] == "0.10.0"
    assert int(versions["mcp"].split(".")[0]) < 2  # fastmcp 3's; vllm 0.32 asks mcp>=2: no one resolution
    assert "torch" not in versions and "spotrl" not in versions
