"""Property: no JSON body, however hostile, gets a 5xx from the fleet's HTTP API, and every answer is valid JSON.

Hypothesis builds bodies from valid requests with fields swapped for hostile values (integers beyond int64,
NaN and infinities, lone UTF-16 surrogates, wrong types, nesting far beyond `max_json_depth`) and from
arbitrary JSON, and sends them to the inference and admin endpoints of the app over the fake backend of
`fake_fleet`. A 4xx is the only acceptable refusal: a 5xx means the request crashed something.
"""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.api import make_app
from tests.support.fake_fleet import BASE, TOKEN, FakeBackend, api_settings

FUZZ = settings(
    max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

EDGE_INTS = [2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, 0, 1, 63, 64, 10**4000]
EDGE_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324, 2.0000001, 1e-6]
EDGE_TEXT = ["", "\ud800", "a\udfffb", "\ud83d\ude00", "\x00", "é" * 50, "policy-v1", BASE, "tiny"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGE_FLOATS),
    st.text(max_size=20),
    st.sampled_from(EDGE_TEXT),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(EDGE_TEXT)), inner)
    ),
    max_leaves=12,
)
deeply_nested = st.builds(
    lambda depth, wrap: wrap[0] * depth + "1" + wrap[1] * depth,
    st.integers(30, 3000),
    st.sampled_from([("[", "]"), ('{"a":', "}"), ('{"model": "tiny", "prompt": [', "]}")]),
)
token_lists = st.lists(st.one_of(st.integers(-5, 70), st.sampled_from(EDGE_INTS)), max_size=6)


def hostile(*valid):
    """Valid values for a field, or anything at all."""
    return st.one_of(st.sampled_from(valid), json_values)


SAMPLING = {
    "n": hostile(1, 2, 4),
    "temperature": hostile(0.0, 0.7, 1.0, 2.0),
    "top_p": hostile(0.5, 1.0),
    "top_k": hostile(-1, 0, 5),
    "min_p": hostile(0.0, 0.1),
    "seed": hostile(7, -1, 2**63 - 1),
    "repetition_penalty": hostile(1.0, 1.2),
    "presence_penalty": hostile(0.0, -2.0),
    "frequency_penalty": hostile(0.0, 2.0),
    "stop": hostile(None, []),
    "stop_token_ids": st.one_of(token_lists, json_values),
    "ignore_eos": hostile(False, True),
    "min_tokens": hostile(0, 1),
    "return_token_ids": hostile(True, False),
    "return_tokens_as_token_ids": hostile(True, None),
    "stream": hostile(False),
    "model": hostile(BASE, "tiny", "policy-v1", "policy-v9"),
}
COMPLETION = {
    **SAMPLING,
    "prompt": st.one_of(
        token_lists, st.lists(token_lists, max_size=4), st.text(alphabet="abc \ud800", max_size=10), json_values
    ),
    "max_tokens": hostile(1, 2, 16, None),
    "logprobs": hostile(None, 0, 2, 20),
    "echo": hostile(False),
    "best_of": hostile(None, 1),
}
MESSAGE = st.fixed_dictionaries(
    {"role": hostile("user", "system")},
    optional={"content": st.one_of(st.text(alphabet="ab \ud800", max_size=8), json_values)},
)
CHAT = {
    **SAMPLING,
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), json_values),
    "max_tokens": hostile(1, None),
    "max_completion_tokens": hostile(2, None),
    "logprobs": hostile(True, False),
    "top_logprobs": hostile(0, 2, None),
    "add_generation_prompt": hostile(True, False),
}
ADMIN = {
    "lora_name": hostile("policy-v1", "x" * 200),
    "lora_path": hostile("adapters/policy-v1"),
    "load_inplace": hostile(False),
}


def bodies(fields):
    """A JSON text: a request with some fields hostile, or any JSON value, or nesting past every limit."""
    requests = st.fixed_dictionaries({}, optional=fields).map(lambda d: {"model": BASE, **d})
    return st.one_of(
        requests.map(lambda d: json.dumps(d)),  # ensure_ascii: lone surrogates as \udXXX, NaN as NaN
        json_values.map(lambda v: json.dumps(v)),
        deeply_nested,
    )


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(FakeBackend(), api_settings()), raise_server_exceptions=False) as client:
        yield client


def assert_no_server_error(response):
    assert response.status_code < 500, response.text[:500]

    def refuse(name):
        raise AssertionError(f"{name} in a response")

    json.loads(response.text, parse_constant=refuse)  # valid, strict JSON, whatever came in


def post(client, path: str, raw: str, **params):
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    return client.post(path, content=raw.encode("utf-8"), headers=headers, params=params)


@FUZZ
@given(raw=bodies(COMPLETION))
def test_completions_never_answer_5xx(client, raw):
    assert_no_server_error(post(client, "/v1/completions", raw))


@FUZZ
@given(raw=bodies(CHAT))
def test_chat_completions_never_answer_5xx(client, raw):
    assert_no_server_error(post(client, "/v1/chat/completions", raw))


@FUZZ
@given(
    path=st.sampled_from(
        ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume", "/reset_prefix_cache"]
    ),
    raw=bodies(ADMIN),
    mode=st.one_of(st.sampled_from(["keep", "wait", "abort"]), st.text(max_size=5)),
)
def test_admin_calls_never_answer_5xx(client, path, raw, mode):
    assert_no_server_error(post(client, path, raw, mode=mode))


TOKEN_GENERATE = {
    "token_ids": st.one_of(token_lists, json_values),
    "sampling_params": st.one_of(
        st.fixed_dictionaries({}, optional={**SAMPLING, "max_tokens": hostile(1, 16, None), "logprobs": hostile(1)}),
        json_values,
    ),
    "return_token_ids": hostile(True, None),
    "request_id": hostile("r1", "\x00"),
}


@FUZZ
@given(raw=bodies(TOKEN_GENERATE), session=st.one_of(st.none(), st.sampled_from(["s1", "x" * 300, "a b", "é"])))
def test_token_generation_never_answers_5xx(client, raw, session):
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    if session is not None:
        headers["X-Session-ID"] = session.encode("utf-8")  # bytes: a header is not ASCII text whatever a client sends
    assert_no_server_error(client.post("/inference/v1/generate", content=raw.encode("utf-8"), headers=headers))
