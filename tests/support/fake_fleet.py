"""The fleet as the API's unit tests see it: a fake backend of two replicas, the settings of a tiny model, and
the calls that tests of several modules make (register a run, sample, load); the fixtures are in `conftest`.
`JSONHandler` is the base of the fake HTTP servers (a flaky fleet, a teacher) that clients are tested against."""

import json
from http.server import BaseHTTPRequestHandler

from contracts.control import (
    AdapterInfo,
    AdapterListing,
    CacheReset,
    Cut,
    CutGenerations,
    ForgetRun,
    ListAdapters,
    LoadAdapter,
    Loaded,
    Pause,
    PauseState,
    Ping,
    Pong,
    ResetPrefixCache,
    Resume,
    RunForgotten,
    UndoLoad,
    UnloadAdapter,
    Unloaded,
)
from contracts.serving import BadRequest, Generated, GenerateRequest, ModelNotFound, SampledChoice
from core.config import FleetSettings
from deployments.api import ApiSettings
from deployments.api.bodies import RequestLimits

TOKEN = "s3cret-token-value"
BASE = "/models/tiny"
TEACHER = "teacher"  # a teacher deployment's model (`api_settings(deployed_models=...)`)
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class FakeBackend:
    """Two replicas that echo, with switches for the failures the API must handle."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.fail_load_on: set[int] = set()
        self.fail_cut_on: set[int] = set()
        self.adapters = {0: set(), 1: set()}

    async def generate(self, request: GenerateRequest) -> Generated:
        self.calls.append(("generate", request))
        if request.model not in (BASE, TEACHER, "policy-v1", "alice/policy-v1", "bob/policy-v1"):
            raise ModelNotFound(f"model {request.model!r} is not loaded")
        sampling = request.sampling
        top = [{5: -0.5, 9: -2.0}, {6: -1.0, 9: -2.5}, {7: -1.5, 9: -3.0}] if sampling.logprobs else None
        scored = None  # as vLLM scores a prompt: its own token at -0.25 x position, and token 9 as an alternative
        if sampling.prompt_logprobs is not None:
            alternative = {9: (float("-inf"), 2)} if sampling.prompt_logprobs else {}
            scored = [None] + [{t: (-0.25 * p, 1), **alternative} for p, t in enumerate(request.prompt_ids) if p > 0]
        choices = [
            SampledChoice(
                index=i,
                token_ids=[5, 6, 7][: sampling.max_tokens],
                logprobs=[-0.5, -1.0, -1.5][: sampling.max_tokens],
                top_logprobs=top[: sampling.max_tokens] if top else None,
                finish_reason="length",
                stop_reason=None,
                prompt_logprobs=scored,
            )
            for i in range(sampling.n)
        ]
        return Generated("r0", choices)

    async def generate_many(self, requests: list[GenerateRequest]) -> list[Generated | Exception]:
        """A bundle (`ServeBackend.generate_many`): recorded as one call, each request answered as `generate` would."""
        self.calls.append(("generate_many", tuple(requests)))
        answers = []
        for request in requests:
            try:
                answers.append(await self.generate(request))
            except Exception as e:
                answers.append(e)
        return answers

    async def broadcast(self, command):
        self.calls.append((type(command).__name__, command))
        out = []
        for replica in (0, 1):
            rid = f"r{replica}"
            match command:
                case LoadAdapter(name=name):
                    if replica in self.fail_load_on:
                        out.append(BadRequest("lora_path is outside the bucket"))
                        continue
                    self.adapters[replica].add(name)
                    out.append(Loaded(rid, loaded=True))
                case UndoLoad(name=name):
                    self.adapters[replica].discard(name)
                    out.append(Unloaded(rid, unloaded=True))
                case UnloadAdapter(name=name):
                    out.append(Unloaded(rid, unloaded=name in self.adapters[replica]))
                    self.adapters[replica].discard(name)
                case ForgetRun(run=run):
                    gone = tuple(sorted(a for a in self.adapters[replica] if a.startswith(f"{run}/")))
                    self.adapters[replica] -= set(gone)
                    out.append(RunForgotten(rid, gone))
                case ListAdapters():
                    infos = tuple(AdapterInfo(a, "file:///b", "sha", 0) for a in sorted(self.adapters[replica]))
                    out.append(AdapterListing(rid, infos))
                case Pause():
                    out.append(PauseState(rid, paused=True))
                case Resume():
                    out.append(PauseState(rid, paused=False))
                case Ping():
                    out.append(Pong(rid))
                case ResetPrefixCache():
                    out.append(CacheReset(rid, True))
                case CutGenerations(models=models):
                    failed = replica in self.fail_cut_on
                    out.append(RuntimeError("engine busy") if failed else Cut(rid, len(models)))
        return out

    async def server_info(self):
        return {
            "lora_config": {"max_lora_rank": 8, "max_loras": 4},
            "parallel_config": {"data_parallel_size": 1},
            "model_config": {"dtype": "torch.float32"},
        }

    def router_stats(self):
        return {"router": "PrefixHashRouter", "totals": {"routed": 0}}

    def sizes(self):
        return {"poison_entries": 0}


def api_settings(**overrides):
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    inverse = {i: c for c, i in vocab.items()}
    settings = dict(
        base_model=BASE,
        base_fingerprint=f"hub:{BASE}@main",  # what `model_fingerprint` says of a name that is no folder here
        model_aliases=frozenset({"tiny"}),
        max_model_len=32,
        vocab_size=64,
        encode=lambda text: [vocab[c] for c in text],
        decode=lambda ids: "".join(inverse.get(i, "?") for i in ids),
        chat_ids=lambda messages, add: [vocab[c] for m in messages for c in m["content"]] + ([26] if add else []),
        admin_token=TOKEN,
    )
    settings.update(overrides)
    return ApiSettings(**settings)


def request_limits(**overrides):
    return RequestLimits.of(FleetSettings(**overrides))


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def register(client, name):
    r = client.post("/v1/runs", json={"name": name}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == name and r.json()["token"].startswith("spotrl-run-")
    return r.json()["token"]


def sample(client, model, headers=None):
    return client.post("/v1/completions", json={"model": model, "prompt": [1], "max_tokens": 1}, headers=headers)


def load(client, name, headers):
    return client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "adapters/policy-v2"}, headers=headers
    )


class JSONHandler(BaseHTTPRequestHandler):
    """An `http.server` handler that answers JSON and logs nothing (fake servers on loopback)."""

    def answer(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass
