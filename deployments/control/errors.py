"""A refusal with its HTTP status, raised by any layer of the ingress and answered by the app's one handler.

The control layer refuses in HTTP's terms (a run that does not fit is a 409, an unknown one a 404) because
the only way its answers leave the ingress is as an HTTP reply or its text. A replica's failure keeps the
status the replica gave it (`contracts.serving.ReplicaError`); what leaves the ingress never shows the admin
token or bucket credentials (`Scrub`).
"""

from __future__ import annotations

from typing import Any

from contracts.auth import redact

# OpenAI's error types, which its client reads.
ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict",  # a run that does not fit the slots, a name already registered
    413: "invalid_request_error",
    415: "invalid_request_error",
}


class ApiError(Exception):
    """Answered as `{"error": {"message", "type", "code"}}` with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or ERROR_KINDS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


def as_api_error(exc: BaseException, context: str) -> ApiError:
    """A replica's error with its own status (`ReplicaError`, also when Ray wraps it), else a 500 naming the type."""
    cause = getattr(exc, "cause", None) or exc
    status = getattr(cause, "status", None)
    if isinstance(status, int) and 400 <= status < 600:
        return ApiError(status, f"{context}: {getattr(cause, 'message', cause)}")
    return ApiError(500, f"{context}: {type(cause).__name__}")


class Scrub:
    """A message as it may leave the ingress (a reply, a log line): credentials and the admin token replaced."""

    def __init__(self, token: str | None):
        self._token = token

    def __call__(self, message: str) -> str:
        message = redact(message)
        return message.replace(self._token, "***") if self._token else message
