"""The clients of the rollout fleet: HTTP for everyone (`FleetClient`), a Serve handle inside its cluster (`ServeFleet`).

The fleet speaks OpenAI's API plus vLLM's admin calls (`deployments/api/`); this wraps the calls
spotrl makes, parses the answers, and retries (with `app.retry`, whose docstring says who retries
what) only what the fleet could not answer: connection failures, timeouts and 502/503/504 while
replicas restart. Generation is retried too, which at worst samples a request twice; a request whose
replica died is retried by the ingress, not here. Admin calls are idempotent on the fleet's side
(loading the same adapter twice is a no-op), so retrying them is safe.

    client = FleetClient("http://127.0.0.1:8000", token=os.environ.get("SPOTRL_ADMIN_TOKEN"))
    client.load_adapter("policy-v3", store.url_of(3))
    choices = client.completions(prompt_ids, model="policy-v3", n=8, max_tokens=6, temperature=1.0)

A learner on another node of the fleet's Ray cluster cannot count on reaching the HTTP proxy (it
listens on the head, at an address as the head sees it): `fleet_admin_client` gives it a `ServeFleet`
for the fleet's in-cluster address (`contracts.serving.serve_address`).

The async calls (a rollout's generations, a teacher's scoring) go through aiohttp, the sync ones (admin calls, a
judge's thread) through httpx: httpx's async connection pool costs its caller milliseconds of CPU per request once
many are in flight (128 single-sample completions to `make serve`'s fleet: 4.3 s through httpx, 0.30 s through
aiohttp; 16 of `n=8`: 0.27 s against 0.20 s, medians of 5), as the Tinker service's and the door's hops found.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

import aiohttp
import httpx

from contracts.auth import Secret
from contracts.retry import Backoff, aretry, retry
from contracts.rollouts import Choice
from contracts.serving import LOGPROB_FLOOR, SERVE_SCHEME

log = logging.getLogger("spotrl.fleet_client")

# Worth another try: the fleet is (re)starting or a replica is being replaced.
RETRY_STATUSES = (502, 503, 504)
DEFAULT_BACKOFF = Backoff(attempts=4, first_s=0.5)
NO_RETRY = Backoff(attempts=1, first_s=0.0)


class FleetError(RuntimeError):
    """A fleet call failed; `status` is the HTTP status (None when the fleet could not be reached)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def worth_retrying(error: BaseException) -> bool:
    """The fleet could not be reached or had no replica to answer: the same call may succeed shortly."""
    return isinstance(error, FleetError) and (error.status is None or error.status in RETRY_STATUSES)


def wire_logprob(value: float) -> float:
    """A log-prob as the server sent it, -inf where it sent vLLM's floor for one (`LOGPROB_FLOOR`)."""
    return -math.inf if value <= LOGPROB_FLOOR else float(value)


def parse_choices(body: dict[str, Any]) -> list[Choice]:
    """Choices of a `/v1/completions` answer, in index order."""
    out = []
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        logprobs = (c.get("logprobs") or {}).get("token_logprobs") or []
        out.append(Choice(c["index"], list(c.get("token_ids") or []), list(logprobs), c["text"], c["finish_reason"]))
    return out


class FleetClient:
    """Sync calls over one `httpx.Client`; the async ones (`acompletions`...) over an `aiohttp.ClientSession` of the
    caller's event loop (a new one if the client is used from another loop: a session serves one loop alone)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 300.0,
        backoff: Backoff = DEFAULT_BACKOFF,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.backoff = backoff
        self.retries_done = 0  # retries made so far, for the caller's metrics
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        # `transport` lets tests talk to the ASGI app in-process; real use goes over TCP.
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=self._headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            trust_env=False,
            transport=transport,
        )
        # As httpx's: each read may take `timeout_s` (a long generation), a connection 10 s.
        self._async_timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_s)
        self._async: aiohttp.ClientSession | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:  # never the token
        return f"FleetClient({self.base_url!r})"

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.close()
            self._async = None

    # ---- plumbing ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs) -> Any:
        def once() -> Any:
            try:
                response = self._client.request(method, path, **kwargs)
            except httpx.TransportError as e:
                raise self._unreachable(method, path, e) from None
            return self._parse(method, path, response.status_code, response.content)

        return retry(once, self.backoff, worth_retrying, self._count_retry)

    async def _arequest(self, method: str, path: str, body: dict[str, Any]) -> Any:
        if self._async is None or self._async_loop is not asyncio.get_running_loop():
            self._async_loop = asyncio.get_running_loop()
            self._async = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._async_timeout,
                connector=aiohttp.TCPConnector(limit=0),  # every request in flight its connection, as httpx's was
                cookie_jar=aiohttp.DummyCookieJar(),  # a fleet sets none; nothing a server says is sent back
            )
        session, url = self._async, self.base_url + path

        async def once() -> Any:
            try:
                async with session.request(method, url, json=body) as response:
                    return self._parse(method, path, response.status, await response.read())
            except (aiohttp.ClientError, TimeoutError) as e:
                raise self._unreachable(method, path, e) from None

        return await aretry(once, self.backoff, worth_retrying, self._count_retry)

    def _unreachable(self, method: str, path: str, error: Exception) -> FleetError:
        return FleetError(f"{method} {self.base_url}{path}: {type(error).__name__}: {error}")

    def _count_retry(self, error: BaseException, attempt: int, pause_s: float) -> None:
        self.retries_done += 1
        log.info("%s; retry %d/%d in %.2fs", error, attempt, self.backoff.attempts - 1, pause_s)

    @staticmethod
    def _parse(method: str, path: str, status: int, content: bytes) -> Any:
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if status >= 400:
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            text = content[:300].decode(errors="replace")
            raise FleetError(f"{method} {path}: {status} {message or text}", status)
        return body

    # ---- inference --------------------------------------------------------------------------------

    @staticmethod
    def _completion_body(prompt_ids, model, n, max_tokens, temperature, top_p, top_k, logprobs, extra) -> dict:
        return {
            "model": model,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "logprobs": logprobs,
            "return_token_ids": True,
            **extra,
        }

    def completions(
        self,
        prompt_ids: list[int],
        model: str,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        logprobs: int = 0,
        **extra: Any,
    ) -> list[Choice]:
        """Sample `n` completions of a token-id prompt under `model` (`policy-vN` or the base model)."""
        body = self._completion_body(prompt_ids, model, n, max_tokens, temperature, top_p, top_k, logprobs, extra)
        return parse_choices(self._request("POST", "/v1/completions", json=body))

    async def acompletions(
        self,
        prompt_ids: list[int] | list[list[int]],
        model: str,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        logprobs: int = 0,
        **extra: Any,
    ) -> list[Choice]:
        """`completions` on the caller's event loop; a batch of prompts gets `n` choices
        per prompt, in prompt order."""
        body = self._completion_body(prompt_ids, model, n, max_tokens, temperature, top_p, top_k, logprobs, extra)
        return parse_choices(await self._arequest("POST", "/v1/completions", body))

    def cut(self, models: list[str]) -> dict[str, Any]:
        """Cut every generation in flight under these adapters (a run's token: its own only): each answers at once,
        finish reason `abort`, with the tokens it had. `{"cut": requests cut, "replicas": ...}`."""
        return self._request("POST", "/v1/cut", json={"models": list(models)})

    async def acut(self, models: list[str]) -> dict[str, Any]:
        """`cut` on the caller's event loop (the rollout's, beside its generations)."""
        return await self._arequest("POST", "/v1/cut", {"models": list(models)})

    @staticmethod
    def _scoring_body(sequences: list[list[int]], model: str, top: int, temperature: float) -> dict:
        return {
            "model": model,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": top,
        }

    @staticmethod
    def _scored(answer: dict[str, Any]) -> list[list[dict[int, float] | None]]:
        return [
            [
                None if at is None else {int(t): wire_logprob(e["logprob"]) for t, e in at.items()}
                for at in c["prompt_logprobs"]
            ]
            for c in sorted(answer["choices"], key=lambda c: c["index"])
        ]

    async def aprompt_logprobs(
        self, sequences: list[list[int]], model: str, top: int = 0, temperature: float = 1.0
    ) -> list[list[dict[int, float] | None]]:
        """Score token-id sequences under `model` (vLLM's `prompt_logprobs` with `max_tokens: 1`, TRL's teacher
        request): per sequence and position, None at the first, else {token id: log-prob} for the sequence's own
        token and the `top` most likely alternatives, at `temperature` (the fleet scores at the request's, as it
        samples; a distilling run sends its sampling temperature, so that teacher and student compare alike)."""
        body = self._scoring_body(sequences, model, top, temperature)
        return self._scored(await self._arequest("POST", "/v1/completions", body))

    def prompt_logprobs(
        self, sequences: list[list[int]], model: str, top: int = 0, temperature: float = 1.0
    ) -> list[list[dict[int, float] | None]]:
        """`aprompt_logprobs` from a thread of its own (a judge's, which reward functions run in)."""
        body = self._scoring_body(sequences, model, top, temperature)
        return self._scored(self._request("POST", "/v1/completions", json=body))

    def tokenize(self, text: str, model: str) -> list[int]:
        """How the server tokenizes `text` (vLLM's `/tokenize`), to compare its tokenizer with ours."""
        return self._request("POST", "/tokenize", json={"model": model, "prompt": text})["tokens"]

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def models(self) -> list[dict[str, Any]]:
        """The base model first, then the loaded adapters (each with `max_model_len`)."""
        return self._request("GET", "/v1/models")["data"]

    def server_info(self) -> dict[str, Any]:
        return self._request("GET", "/server_info", params={"config_format": "json"})

    def router_stats(self) -> dict[str, Any]:
        return self._request("GET", "/router/stats")

    def engine_stats(self) -> list[dict[str, Any]]:
        """vLLM's counters per replica: prefix-cache queries and hits, tokens, running and waiting requests."""
        return self._request("GET", "/engine/stats")["replicas"]

    # ---- admin (every replica or none) -------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load `name` (e.g. `policy-v3`) on every replica from `path`, a bucket URL or a path inside the bucket."""
        return self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> dict[str, Any]:
        """Unload everywhere once in-flight requests finish; an unknown name is not an error."""
        return self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def register_run(
        self,
        name: str,
        weight: float | None = None,
        *,
        max_staleness: int | None = None,
        lora_rank: int | None = None,
        lineages: int | None = None,
    ) -> dict[str, Any]:
        """Register a run on a shared fleet (admin token), with its `weight` in the fair share, the staleness window
        its versions pin, the LoRA rank it trains and the lineages it publishes (2 with an ema average; each else
        the fleet's default): `{"name", "token", "weight", "max_staleness", "lora_rank", "lineages"}`, the run's
        token shown this once."""
        terms = {"weight": weight, "max_staleness": max_staleness, "lora_rank": lora_rank, "lineages": lineages}
        body = {"name": name, **{k: v for k, v in terms.items() if v is not None}}
        return self._request("POST", "/v1/runs", json=body)

    def remove_run(self, name: str) -> dict[str, Any]:
        """Forget a run (its token stops working) and unload its adapters (admin token)."""
        return self._request("DELETE", f"/v1/runs/{name}")

    def list_runs(self) -> list[str]:
        """The runs registered on a shared fleet (admin token); a run's token gets its own name alone."""
        return self._request("GET", "/v1/runs")["runs"]

    def run_info(self, name: str) -> dict[str, Any]:
        """Run `name` as the fleet sees it (its token or the admin's): `{"name", "bucket_url", "idle_timeout_s",
        "weight", "max_staleness", "lora_rank"}`, `bucket_url` being the run's prefix of the fleet's bucket, where it
        must publish."""
        return self._request("GET", f"/v1/runs/{name}")

    def signing_key(self, run: str | None = None) -> Secret:
        """The key this caller's lineage signs its versions with: a run's token its run's, the admin token the fleet's
        own lineage's (or run `run`'s). The fleet loads only versions that verify under it."""
        return Secret(self._request("GET", "/v1/signing_key", params={"run": run} if run else None)["key"])

    def heartbeat(self, name: str) -> dict[str, Any]:
        """Tell a shared fleet that run `name` is alive (its token or the admin's); any request of the run counts too."""
        return self._request("POST", f"/v1/runs/{name}/heartbeat")

    def pause(self, mode: str = "keep") -> dict[str, Any]:
        return self._request("POST", "/pause", params={"mode": mode})

    def resume(self) -> dict[str, Any]:
        return self._request("POST", "/resume")

    def reset_prefix_cache(self) -> dict[str, Any]:
        return self._request("POST", "/reset_prefix_cache")


class ServeFleet:
    """The fleet's admin calls over a DeploymentHandle to its ingress: what `FleetClient` is over HTTP.

    A handle reaches the ingress from any node of the cluster and follows it across restarts
    (Serve tells every handle where the deployment's replicas are), so no node needs the proxy's
    address. Only what weight sync calls is here: `load_adapter` and `close`.
    """

    def __init__(self, address: str, timeout_s: float):
        self.app_name = address.removeprefix(SERVE_SCHEME)
        self.timeout_s = timeout_s
        self._ingress = None

    def __repr__(self) -> str:
        return f"ServeFleet({self.app_name!r})"

    def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """`FleetClient.load_adapter`: on every live replica or none; TimeoutError after `timeout_s`.

        A call past its deadline is not cancelled: the ingress finishes the load or rolls it back."""
        from ray import serve

        if self._ingress is None:  # looked up on first use: the application may be (re)deployed after we start
            self._ingress = serve.get_app_handle(self.app_name)
        return self._ingress.load_adapter.remote(name, path).result(timeout_s=self.timeout_s)

    def close(self) -> None:
        self._ingress = None


def fleet_admin_client(address: str, token: str | None, timeout_s: float) -> FleetClient | ServeFleet:
    """A client of the fleet's admin calls: a Serve handle for `serve://<app>` (in the cluster), else HTTP."""
    if address.startswith(SERVE_SCHEME):
        return ServeFleet(address, timeout_s)
    return FleetClient(address, token=token, timeout_s=timeout_s)
