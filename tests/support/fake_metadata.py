"""A fake cloud metadata server on 127.0.0.1: EC2's IMDS (v2 tokens, v1 when tokens are refused) and GCE's.

Tests point the clouds' own endpoint variables at it (`env()`: AWS_EC2_METADATA_SERVICE_ENDPOINT,
GCE_METADATA_HOST), so that nothing ever contacts 169.254.169.254, and post notices with `aws_notice`,
`aws_rebalance`, `gcp_preempt`, `gcp_maintenance`. It counts what it was asked (`requests`), so a test can
tell that a token was fetched once and sent with every GET.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "fake-imds-token"


class FakeMetadata:
    def __init__(self, *, refuse_tokens: bool = False, cloud: str = "both"):
        self.refuse_tokens, self.cloud = refuse_tokens, cloud
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None
        self.preempted = False
        self.maintenance = "NONE"
        self.token_failures: list[int] = []  # statuses the next token requests answer (a throttled or failing IMDS)
        self.requests: list[tuple[str, str, dict]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # ---- control ---------------------------------------------------------------------------------

    def __enter__(self) -> FakeMetadata:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def env(self) -> dict[str, str]:
        """The SDKs' variables that point at this server."""
        return {
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{self.port}/",
            "GCE_METADATA_HOST": f"127.0.0.1:{self.port}",
        }

    def aws_notice(self, in_s: float, action: str = "terminate") -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
        self.instance_action = {"action": action, "time": stamp}

    def aws_rebalance(self) -> None:
        self.rebalance = {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def fail_tokens(self, *statuses: int) -> None:
        """The next token requests answer these statuses, one each (429: throttled, 5xx: failing), then tokens."""
        self.token_failures.extend(statuses)

    def gcp_preempt(self) -> None:
        self.preempted = True

    def gcp_maintenance(self, event: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        self.maintenance = event

    # ---- the server ------------------------------------------------------------------------------

    def _answer(self, method: str, path: str, headers: dict) -> tuple[int, str, dict]:
        self.requests.append((method, path, headers))
        if path.startswith("/latest/") and self.cloud in ("both", "aws"):
            return self._aws(method, path, headers)
        if path.startswith("/computeMetadata/v1/") and self.cloud in ("both", "gcp"):
            return self._gcp(path, headers)
        return 404, "not found", {}

    def _aws(self, method: str, path: str, headers: dict) -> tuple[int, str, dict]:
        if method == "PUT" and path == "/latest/api/token":
            if self.token_failures:
                return self.token_failures.pop(0), "token request failed", {}
            return (403, "tokens refused", {}) if self.refuse_tokens else (200, TOKEN, {})
        if not self.refuse_tokens and headers.get("x-aws-ec2-metadata-token") != TOKEN:
            return 401, "unauthorized", {}
        answers = {
            "/latest/meta-data/instance-id": "i-0123456789",
            "/latest/meta-data/spot/instance-action": self.instance_action and json.dumps(self.instance_action),
            "/latest/meta-data/events/recommendations/rebalance": self.rebalance and json.dumps(self.rebalance),
        }
        body = answers.get(path)
        return (200, body, {}) if body else (404, "not found", {})

    def _gcp(self, path: str, headers: dict) -> tuple[int, str, dict]:
        if headers.get("metadata-flavor") != "Google":
            return 403, "missing Metadata-Flavor", {}
        answers = {
            "/computeMetadata/v1/instance/id": "1234567890",
            "/computeMetadata/v1/instance/preempted": "TRUE" if self.preempted else "FALSE",
            "/computeMetadata/v1/instance/maintenance-event": self.maintenance,
        }
        body = answers.get(path)
        return (200, body, {"Metadata-Flavor": "Google"}) if body else (404, "not found", {})

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, method: str) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, body, extra = fake._answer(method, self.path, headers)
                data = body.encode()
                self.send_response(status)
                for key, value in {"Content-Length": str(len(data)), **extra}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server's names
                self._reply("GET")

            def do_PUT(self):  # noqa: N802
                self._reply("PUT")

            def log_message(self, *args):
                pass

        return Handler
