"""Bad input: a 4xx with an OpenAI error body naming the field, never a 500 or a traceback."""

from __future__ import annotations

import io
import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.errors import InvalidRequest, PayloadTooLarge
from mesh.request import Limits, parse

OK = {"model": "mock-model", "prompt": "hi"}
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}

CASES = [
    ("completions", b"{not json", None),
    ("completions", b"", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "hi"}, "model"),
    ("completions", {"model": 3, "prompt": "hi"}, "model"),
    ("completions", {"model": ""}, "model"),
    ("completions", {"model": "m"}, "prompt"),
    ("completions", {"model": "m", "prompt": 5}, "prompt"),
    ("completions", {"model": "m", "prompt": ""}, "prompt"),
    ("completions", {"model": "m", "prompt": ["a", 3]}, "prompt[1]"),
    ("completions", {"model": "m", "prompt": [1, -2]}, "prompt[1]"),
    ("completions", {**OK, "max_tokens": -1}, "max_tokens"),
    ("completions", {**OK, "max_tokens": 0}, "max_tokens"),
    ("completions", {**OK, "max_tokens": 10 ** 12}, "max_tokens"),
    ("completions", {**OK, "max_tokens": "5"}, "max_tokens"),
    ("completions", {**OK, "max_tokens": True}, "max_tokens"),
    ("completions", {**OK, "max_tokens": 1.5}, "max_tokens"),
    ("completions", {**OK, "stream": "yes"}, "stream"),
    ("completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {**OK, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("completions", {**OK, "temperature": 5}, "temperature"),
    ("completions", {**OK, "temperature": "hot"}, "temperature"),
    ("completions", {**OK, "top_p": -0.1}, "top_p"),
    ("completions", {**OK, "n": 129}, "n"),
    ("completions", {**OK, "stop": [1]}, "stop"),
    ("completions", {**OK, "user": 7}, "user"),
    ("completions", {**OK, "kv_transfer_params": {}}, "kv_transfer_params"),
    ("chat", {"model": "m"}, "messages"),
    ("chat", {"model": "m", "messages": []}, "messages"),
    ("chat", {"model": "m", "messages": "hi"}, "messages"),
    ("chat", {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [1]}]}, "messages[0].content[0]"),
    ("chat", {**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
]


@pytest.mark.parametrize("kind,body,param", CASES)
def test_parse_names_the_field(kind, body, param):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(InvalidRequest) as e:
        parse(kind, raw, Limits())
    assert e.value.param == param
    assert e.value.status == 400
    if param:
        assert param in e.value.message


def test_parse_valid_and_passthrough():
    r = parse("chat", orjson.dumps({**CHAT, "max_tokens": 9, "max_completion_tokens": 4, "my_field": [1],
                                    "stream": True, "stream_options": {"include_usage": True}}), Limits())
    assert (r.max_tokens, r.stream, r.include_usage) == (4, True, True)
    assert r.body["my_field"] == [1]


def test_body_and_prompt_limits():
    with pytest.raises(PayloadTooLarge):
        parse("completions", orjson.dumps({**OK, "prompt": "x" * 2000}), Limits(max_body_bytes=1000))
    with pytest.raises(InvalidRequest) as e:
        parse("completions", orjson.dumps({**OK, "prompt": "x" * 2000}), Limits(max_prompt_chars=100))
    assert e.value.param == "prompt"


@pytest.mark.parametrize("kind,body,param", [c for c in CASES if c[2] is not None][::3])
async def test_http_bad_input_gets_400_naming_field(make_pd, http, kind, body, param):
    pd = await make_pd()
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    async with http.post(pd.url + path, data=orjson.dumps(body),
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        e = (await r.json())["error"]
    assert e["param"] == param and e["type"] == "invalid_request_error"
    assert sum(p.requests for p in pd.fleet.prefills) == 0


async def test_http_malformed_json_and_unknown_model(make_pd, http):
    pd = await make_pd()
    async with http.post(pd.url + "/v1/completions", data=b"{oops",
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert "not valid JSON" in (await r.json())["error"]["message"]
    async with http.post(pd.url + "/v1/completions", json={"model": "other", "prompt": "x"}) as r:
        assert r.status == 404
        e = (await r.json())["error"]
        assert (e["param"], e["code"]) == ("model", "model_not_found")
    async with http.post(pd.url + "/v1/completions", data=io.BytesIO(b"x" * (9 * 1024 * 1024))) as r:
        assert r.status == 413
    async with http.get(pd.url + "/v1/nothing") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "404"


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)
fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "stream", "stream_options", "temperature",
                          "top_p", "n", "stop", "user", "max_completion_tokens", "seed", "other"])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(kind=st.sampled_from(["completions", "chat"]),
       body=st.dictionaries(fields, json_values, max_size=8) | json_values)
def test_parse_never_raises_anything_but_a_4xx(kind, body):
    try:
        parse(kind, json.dumps(body).encode(), Limits())
    except (InvalidRequest, PayloadTooLarge) as e:
        assert 400 <= e.status < 500
        assert "Traceback" not in e.message
