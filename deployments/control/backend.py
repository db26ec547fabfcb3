"""The fleet as the ingress's logic sees it: one `Backend`, which Ray Serve provides in production.

Everything above this seam (the control layer, the HTTP routes) is independent of Ray, so it runs and is
unit-tested over a fake backend; `deployments.ingress.shell.ServeBackend` is the real one, over a Serve handle.
"""

from __future__ import annotations

from typing import Any, Protocol

from contracts.control import Command
from contracts.serving import Generated, GenerateRequest


class Backend(Protocol):
    """What the ingress needs from the fleet (Ray Serve in production, a fake in unit tests)."""

    async def generate(self, request: GenerateRequest) -> Generated: ...

    async def generate_many(self, requests: list[GenerateRequest]) -> list[Generated | Exception]:
        """Requests that route alike in one replica call: each one's answer or failure, in order."""
        ...

    async def broadcast(self, command: Command) -> list[Any]:
        """Send `command` to every live replica (`contracts.control`); its typed reply or exception per replica."""
        ...

    async def server_info(self) -> dict[str, Any]: ...

    def router_stats(self) -> dict[str, Any]: ...

    def sizes(self) -> dict[str, int]:
        """What it keeps per request, counted: `poison_entries` (`deployments.control.tables`)."""
        ...
