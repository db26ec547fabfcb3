"""Nothing that `make train` starts connects beyond the machine: the embedded default asks no address but loopback.

Beside `test_loopback.py` (what the run listens on), this records what the run connects to: a short embedded run
under `strace -f -e trace=connect`, every process and thread of it (the driver, Ray's GCS, raylet, dashboard and
agents, every worker, the vLLM engines under the replicas), and fails on any connection attempt to an address
outside 127.0.0.0/8 and ::1, and on any DNS query (port 53, even to a resolver on loopback such as
systemd-resolved's 127.0.0.53, which asks beyond). What it caught once, each switched off by its owner's setting:
spotrl's spot watcher asking 169.254.169.254 off a cloud (`spot.metadata: auto`), and each vLLM engine routing a
socket to 8.8.8.8 to learn its own address (`VLLM_HOST_IP`, `deployments.replica.engine`); Ray's usage reports are
off too (`core.local_ray.NO_USAGE_STATS_ENV`).

One is left, by name: Ray 2.60's dashboard asks which cloud it runs on at start-up (`UsageStatsHead.run` ->
`usage_lib.get_cloud_from_metadata_requests`: Azure's and AWS's 169.254.169.254:80, and metadata.google.internal
through the resolver) before it looks whether usage stats are enabled, and no Ray setting skips it. It is allowed
from the dashboard's own process only, to exactly those addresses, until Ray has a switch.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_train import train_cmd

REPO = Path(__file__).resolve().parents[2]
# What conftest.py sets so that no test reaches beyond loopback: a fresh user's shell has none of it, and what is
# tested here is that the run itself needs none of it.
TEST_GUARDS = (
    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "GCE_METADATA_HOST",
    "RAY_USAGE_STATS_ENABLED",
    "VLLM_NO_USAGE_STATS",
    "DO_NOT_TRACK",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_HOST_IP",
)
# strace's rendering of an IPv4 or IPv6 socket address: `sin_port=htons(80), sin_addr=inet_addr("169.254.169.254")`,
# `sin6_port=htons(53), ..., inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr)`.
INET_ADDRESS = re.compile(r'sa_family=AF_INET6?,\s*sin6?_port=htons\((\d+)\).*?"([0-9A-Fa-f:.]+)"')
RAY_DASHBOARD = "ray/dashboard/dashboard.py"  # its process's command line, in strace's `execve` line
RAY_CLOUD_PROBE = {("169.254.169.254", 80), ("", 53)}  # its metadata requests and its DNS query ("": any resolver)


def on_the_machine(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as Ray's gRPC dials loopback
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def beyond_the_machine(trace: str) -> list[str]:
    """The `connect` lines of an `strace -f -e trace=connect,execve` log that reach beyond the machine or ask a
    resolver, but Ray's dashboard's cloud probe (`RAY_CLOUD_PROBE`, from the process that ran `RAY_DASHBOARD`)."""
    lines = trace.splitlines()
    dashboard = {line.split(maxsplit=1)[0] for line in lines if "execve(" in line and RAY_DASHBOARD in line}
    found = []
    for line in lines:
        match = INET_ADDRESS.search(line) if "connect(" in line else None
        if not match or (on_the_machine(match[2]) and int(match[1]) != 53):
            continue
        port = int(match[1])
        if line.split(maxsplit=1)[0] in dashboard and (match[2] if port != 53 else "", port) in RAY_CLOUD_PROBE:
            continue
        found.append(line)
    return found


def test_the_trace_reading_finds_what_leaves_the_machine():
    lines = [
        '1 connect(5, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("169.254.169.254")}, 16) = -1',
        '2 connect(12, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("8.8.8.8")}, 16) = 0',
        '3 connect(9, {sa_family=AF_INET6, sin6_port=htons(80), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "2001:4860:4860::8888", &sin6_addr), sin6_scope_id=0}, 28 <unfinished ...>',
        '4 connect(60, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("127.0.0.53")}, 16) = 0',
        '10 connect(7, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("169.254.169.254")}, 16) = 0',
    ]
    on_loopback = [
        '5 connect(8, {sa_family=AF_INET6, sin6_port=htons(35353), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = -1 EINPROGRESS',
        '6 connect(4, {sa_family=AF_INET, sin_port=htons(6379), sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
        '7 connect(4, {sa_family=AF_INET6, sin6_port=htons(8000), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = 0',
        '8 connect(3, {sa_family=AF_UNIX, sun_path="/tmp/ray/session_latest/sockets/raylet"}, 110) = 0',
        "9 <... connect resumed>) = 0",
        '10 execve("/x/.venv/bin/python", ["/x/.venv/bin/python", "-u", "/x/site-packages/ray/dashboard/dashboard.py"',
        '10 connect(60, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("169.254.169.254")}, 16) = -1',
        '10 connect(60, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.255.255.53")}, 16) = 0',
    ]
    assert beyond_the_machine("\n".join(lines + on_loopback)) == lines


def test_make_train_connects_to_nothing_beyond_loopback(tmp_path, tiny_model_path):
    """`make train`'s embedded default (tiny model, CPU, file:// bucket), two steps, one replica instead of two (the
    same processes, one engine fewer), in a shell without the tests' guards."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: nothing to record the run's connections with (apt-get install strace)")
    trace = tmp_path / "connect.trace"
    # --seccomp-bpf: only connect and execve stop the traced processes (the kernel filters the rest), so the run is
    # hardly slower than without strace (it took 5 minutes on CI with every syscall stopping).
    record = [strace, "-f", "--seccomp-bpf", "-qq", "-s", "256", "-e", "trace=connect,execve", "-o", str(trace)]
    env = {k: v for k, v in os.environ.items() if k not in TEST_GUARDS}
    proc = subprocess.run(
        [*record, *train_cmd(tmp_path, 2, "fleet.num_replicas=1")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**env, "TRACKIO_DIR": str(tmp_path / "trackio")},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (tmp_path / "smoke" / "summary.json").is_file(), "the run finished without its summary"
    recorded = trace.read_text()
    threads = {line.split(maxsplit=1)[0] for line in recorded.splitlines() if "connect(" in line}
    assert len(threads) > 10, f"strace followed too little of the run ({len(threads)} threads):\n{recorded[:3000]}"
    outside = beyond_the_machine(recorded)
    assert not outside, "connections beyond loopback (strace -f -e trace=connect; pid first):\n" + "\n".join(outside)
