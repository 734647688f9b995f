"""Fuzzing the OpenAI endpoints (issue 15): random request bodies -- valid fields with values of every JSON
type and edge numbers, junk fields, malformed messages, tools and formats -- never get a 5xx; each answer is
JSON with either choices or an OpenAI-shaped error. Bounded and derandomized: the same examples every run of
the same selection of tests (hypothesis also draws constants from the project's modules that are loaded, so
this file alone draws other examples than the whole suite, where more of them are: 48 against 64 answered
completions of 150 on 2026-12-03)."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import Tokenizer
from clover.serving.app import ServerConfig, build_app

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10)
SMALL_INT = st.integers(-3, 24)
NUMBER = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot"]) | JSON},
    optional={"content": st.text(max_size=40) | JSON, "tool_calls": st.lists(
        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.text(max_size=8), "arguments": st.text(max_size=20) | JSON})}), max_size=2) | JSON,
              "name": JSON, "tool_call_id": JSON, "reasoning_content": st.text(max_size=10) | JSON})
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather", "bad name!"]) | st.text(max_size=6)},
    optional={"parameters": st.fixed_dictionaries({"type": st.sampled_from(["object", "string"])}, optional={
        "properties": st.dictionaries(st.text(max_size=4), st.fixed_dictionaries(
            {"type": st.sampled_from(["string", "integer", "boolean", "array", "zzz"])}) | JSON, max_size=3) | JSON,
        "required": st.lists(st.text(max_size=4), max_size=2) | JSON}) | JSON, "description": JSON})})
SHARED = {
    "model": st.sampled_from(["m", "other"]) | JSON, "max_tokens": SMALL_INT | JSON, "temperature": NUMBER | JSON,
    "top_p": NUMBER, "top_k": SMALL_INT, "n": st.integers(-1, 10), "seed": st.integers(-5, 2**70),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | JSON, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "repetition_penalty": NUMBER,
    "algorithm": st.sampled_from(["ar", "verify", "low_confidence", "magic"]), "block_size": st.integers(-2, 70),
    "threshold": NUMBER, "max_accept_per_step": SMALL_INT, "ignore_eos": st.booleans() | JSON,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "5", "x", "99999"]), NUMBER, max_size=3) | JSON,
    "min_tokens": SMALL_INT | JSON, "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
             "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False}}},
         ]) | JSON,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | JSON, "guided_regex": st.sampled_from(
        ["[a-z]{1,3}", "(", "\\d+"]) | JSON, "frobnicate": JSON,
}
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4) | JSON}, optional={
    **SHARED, "tools": st.lists(TOOL, max_size=2) | JSON, "logprobs": st.booleans() | JSON,
    "top_logprobs": SMALL_INT, "parallel_tool_calls": st.booleans() | JSON, "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "x"]), JSON, max_size=2) | JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
    | JSON})
# mostly valid bodies, so that generation, streaming, tools, logprobs and grammars run too
VALID_TOOL = st.sampled_from([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "f"}}])
VALID = {
    "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50), "n": st.integers(1, 3), "seed": st.integers(0, 2**31),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "algorithm": st.sampled_from(["ar", "verify", "low_confidence"]),
    "block_size": st.sampled_from([4, 8, 16]), "threshold": st.floats(0, 1), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3), "logit_bias": st.dictionaries(st.sampled_from(["5", "7"]), st.floats(-5, 5),
                                                                   max_size=2),
    "guided_choice": st.just(["yes", "no"]), "response_format": st.just({"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                                "additionalProperties": False}}}),
}
VALID_CHAT = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.just("user"), "content": st.text(min_size=1, max_size=30)}), min_size=1, max_size=2)}, optional={
    **VALID, "tools": st.lists(VALID_TOOL, min_size=1, max_size=2, unique_by=lambda x: x["function"]["name"]),
    "tool_choice": st.sampled_from(["auto", "none", "required"]), "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3), "chat_template_kwargs": st.fixed_dictionaries(
        {"enable_thinking": st.booleans()})})
VALID_COMPLETION = st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20) | st.lists(
    st.integers(0, 299), min_size=1, max_size=6)}, optional={**VALID, "echo": st.booleans(),
                                                          "logprobs": st.integers(0, 3)})
COMPLETION = st.fixed_dictionaries({"prompt": st.text(max_size=30) | st.lists(st.integers(-3, 300), max_size=6)
                                    | st.lists(st.text(max_size=5), max_size=3) | JSON}, optional={
    **SHARED, "echo": st.booleans() | JSON, "logprobs": SMALL_INT | JSON})


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    tok = Tokenizer.train(["the weather in paris and rome, the tool and the call"] * 20, vocab_size=300)
    config = CloverConfig.preset("debug", vocab_size=300, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids, max_position_embeddings=256)
    torch.manual_seed(0)   # a real (random, tiny) model: every decoder and every forward mode runs
    # a request without max_tokens writes up to 24 tokens, not the server's default 512 cut to the 256-token context
    # (up to 2.8 s a request on 2 cores: the two never-5xx tests took 39 s alone; the file 21 s with 24; 2026-12-06)
    app = build_app(CloverForCausalLM(config).eval(), tok, ServerConfig(model_name="m", max_body_bytes=64 << 10,
                                                                           default_max_tokens=24))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


STATUS: dict[str, list[int]] = {}


def _check(response, kind: str) -> None:
    STATUS.setdefault(kind, []).append(response.status_code)
    assert response.status_code < 500, response.text[:300]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "choices" in event or "error" in event
        return
    body = response.json()
    assert ("choices" in body) != ("error" in body), body
    if "error" in body:
        assert {"message", "type", "param", "code"} <= set(body["error"]) and response.status_code >= 400


def _send(http, path, body):
    return http.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(body=VALID_CHAT | CHAT)
def test_chat_completions_never_answer_5xx(http, body):
    _check(_send(http, "/v1/chat/completions", body), "chat")


@FUZZ
@given(body=VALID_COMPLETION | COMPLETION)
def test_completions_never_answer_5xx(http, body):
    _check(_send(http, "/v1/completions", body), "completions")


def test_the_fuzzing_reaches_generation():
    """Not only refusals: a share of the random requests were valid and answered (run after the two above)."""
    for kind in ("chat", "completions"):
        codes = STATUS.get(kind, [])
        assert len(codes) >= 100 and codes.count(200) >= 10, (kind, sorted(set(codes)), codes.count(200))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JSON)
def test_any_json_at_all_gets_a_4xx(http, body):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        response = _send(http, path, body)
        assert 400 <= response.status_code < 500 or (isinstance(body, dict) and response.status_code == 200), \
            (path, response.text[:200])
