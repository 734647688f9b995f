"""The OpenAI-compatible server: the real `clover serve` as a subprocess, driven by the openai client,
plus an in-process server over a scripted model for tool calls."""

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fakes import TextScriptModel

from clover.cli.commands import main as cli_main
from clover.model.config import CloverConfig, ConfigError
from clover.model.tokenizer import Tokenizer, TokenizerError
from clover.serving.app import ServerConfig, build_app
from clover.serving.local import serve_in_thread

THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url, proc=None, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError("server did not start")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv") / "m"
    assert cli_main(["init", str(d), "--preset", "debug", "--seed", "3"]) == 0
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clover", "serve", "--model", str(d), "--port", str(port),
                             "--served-model-name", "debug", "--max-batch-size", "16", "--max-queue", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, proc)
    yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    proc.terminate()
    proc.wait(timeout=30)


def test_models_and_health(server):
    url, client = server
    models = client.models.list()
    assert [m.id for m in models.data] == ["debug"]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_chat_thinking_on_and_off(server):
    _, client = server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    on = client.chat.completions.create(model="debug", messages=msgs, max_tokens=12, extra_body={"ignore_eos": True})
    assert on.object == "chat.completion" and on.choices[0].finish_reason == "length"
    extra = on.choices[0].message.model_extra
    assert isinstance(extra["reasoning_content"], str) and extra["reasoning"] == extra["reasoning_content"]
    assert on.usage.completion_tokens == 12 and on.usage.model_extra["nfe"] >= 1 and on.usage.model_extra["tpf"] > 0
    off = client.chat.completions.create(model="debug", messages=msgs, max_tokens=12, extra_body={**THINK_OFF,
                                                                                                  "ignore_eos": True})
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert isinstance(off.choices[0].message.content, str) and len(off.choices[0].message.content) > 0


def test_streaming_with_usage_equals_the_plain_reply(server):
    _, client = server
    kw = dict(model="debug", messages=[{"role": "user", "content": "Count"}], max_tokens=20,
              extra_body={**THINK_OFF, "ignore_eos": True, "block_size": 8})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    # at most one chunk per committed block (the parser may hold back trailing whitespace)
    assert 1 < len(content_chunks) <= chunks[-1].usage.model_extra["blocks"] <= 4


def test_completions_plain_and_streamed(server):
    _, client = server
    r = client.completions.create(model="debug", prompt="def f(x):", max_tokens=10, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="debug", prompt="def f(x):", max_tokens=10, stream=True, extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == r.choices[0].text


def test_sixteen_concurrent_streams_equal_each_alone(server):
    _, client = server
    prompts = [f"Item {i}: " + "word " * (i % 5) for i in range(16)]

    def run(prompt, stream):
        kw = dict(model="debug", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                  extra_body={**THINK_OFF, "ignore_eos": True, "threshold": 0.5})
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)

    alone = [run(p, False) for p in prompts]
    results = [None] * 16

    def worker(i):
        results[i] = run(prompts[i], True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == alone


BAD = [
    ("not json", b"{bad", 400, None),
    ("array body", b"[1, 2]", 400, None),
    ("no messages", {"model": "debug"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("content number", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("max_tokens string", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens zero", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("temperature high", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
    ("top_p zero", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("n too large", {"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n"),
    ("seed negative", {"messages": [{"role": "user", "content": "x"}], "seed": -1}, 400, "seed"),
    ("stop number", {"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop"),
    ("bad algorithm", {"messages": [{"role": "user", "content": "x"}], "algorithm": "beam"}, 400, "algorithm"),
    ("threshold > 1", {"messages": [{"role": "user", "content": "x"}], "threshold": 3}, 400, "threshold"),
    ("block size 0", {"messages": [{"role": "user", "content": "x"}], "block_size": 0}, 400, "block_size"),
    ("tool bad type", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "shell"}]}, 400, "tools.0.type"),
    ("tool bad schema", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400, "tools"),
    ("tool bad name", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "no spaces allowed"}}]}, 400, "tools"),
    ("tool bad parameter name", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a>b": {"type": "string"}}}}}]}, 400, "tools"),
    ("two tools of one name", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("misspelt structured output", {"messages": [{"role": "user", "content": "x"}],
                                    "structured_outputs": {"regx": "a+"}}, 400, "structured_outputs"),
    ("misspelt stream option", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                "stream_options": {"include_usge": True}}, 400, "stream_options"),
    ("tool_choice unknown", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("tool_choice without tools", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("bad tool arguments", {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "messages"),
    ("prompt too long", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    ("max_tokens over context", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400, "max_tokens"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("logprobs from block diffusion", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                       "algorithm": "low_confidence"}, 400, "logprobs"),
    ("thinking not bool", {"messages": [{"role": "user", "content": "x"}],
                           "chat_template_kwargs": {"enable_thinking": "yes"}}, 400, "chat_template_kwargs.enable_thinking"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_malformed_and_hostile_inputs_get_the_documented_4xx(server, name, body, status, param):
    url, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] and err["param"].startswith(param), err
    assert httpx.get(url + "/health").status_code == 200  # still serving


def test_completions_errors_and_unknown_routes(server):
    url, _ = server
    assert httpx.post(url + "/v1/completions", json={"prompt": ""}).status_code == 400
    batch = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}, timeout=60).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]          # a batch of prompts: one choice each
    assert httpx.post(url + "/v1/completions", json={"prompt": ["a"] * 65}).status_code == 400
    assert httpx.post(url + "/v1/completions", json={"prompt": ["a", ""]}).status_code == 400
    long = httpx.post(url + "/v1/completions", json={"prompt": "word " * 3000}, timeout=60)
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_a_disconnected_stream_releases_its_capacity(server):
    url, client = server
    body = {"model": "debug", "messages": [{"role": "user", "content": "go"}], "max_tokens": 900, "stream": True,
            "ignore_eos": True, "threshold": 1.0, **THINK_OFF}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            break  # read one chunk, then hang up
    deadline = time.time() + 10
    while time.time() < deadline and httpx.get(url + "/health").json()["running"]:
        time.sleep(0.05)
    assert httpx.get(url + "/health").json()["running"] == 0
    assert _metric(url, "clover_requests_aborted_total") >= 1
    t0 = time.time()
    client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert time.time() - t0 < 10


def _wait_running(url, n, timeout=10):
    deadline = time.time() + timeout
    while (seen := httpx.get(url + "/health").json())["running"] != n:
        assert time.time() < deadline, f"never {n} requests running: {seen}"
        time.sleep(0.01)


def _slow_app(target, config, tok, seconds=0.02, **kw):
    """An app over a scripted model whose forwards take `seconds`, so that requests overlap in the batch."""
    class Slow(TextScriptModel):
        def causal(self, *a, **k):
            time.sleep(seconds)
            return super().causal(*a, **k)

    return build_app(Slow(target, config), tok, ServerConfig(model_name="m"), generation_defaults={"algorithm": "ar"},
                     **kw)


def _two_stream_app():
    """A slow scripted app, and a streamed chat body of 100 tokens (2 s at 20 ms a forward)."""
    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "ignore_eos": True,
            "stream": True, **THINK_OFF}
    return _slow_app(tok.encode("some text ") * 60, config, tok), body


def _second_after_first_leaves(url, body):
    """Two streams running (the first in the lower row); the first's client hangs up: the second's lines after."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as first:
        held = first.iter_lines()   # kept: a dropped iterator would close the stream
        next(held)
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as second:
            lines = second.iter_lines()
            next(lines)
            _wait_running(url, 2)
            first.close()
            deadline = time.time() + 1.0   # aborted at once
            while httpx.get(url + "/health").json()["running"] == 2:
                assert time.time() < deadline, "the first request still runs 1 s after its client left"
                time.sleep(0.01)
            return list(lines)


def test_a_client_that_hangs_up_below_another_request_leaves_it_and_the_server_running():
    """Found by a hostile pass: the abort compacts the batch's rows, writing the cache in place outside inference
    mode, which torch refused: the engine thread died, the other stream stalled, /health said ok and every later
    request hung. Now the other stream ends whole and the server answers."""
    app, body = _two_stream_app()
    with serve_in_thread(app) as url:
        rest = _second_after_first_leaves(url, body)
        assert "data: [DONE]" in rest and not any('"error"' in line for line in rest)
        assert sum(line.startswith("data: {") for line in rest) >= 50   # its tokens went on arriving
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        done = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


def test_a_bug_between_steps_fails_the_requests_in_flight_and_the_engine_thread_goes_on(monkeypatch):
    """Whatever raises on the engine thread outside a request's own failure (here its abort) ends the requests
    in flight with a server error, never the thread; /health says 503 only once the thread has ended."""
    from clover.engine.engine import Engine

    app, body = _two_stream_app()
    real_abort = Engine.abort
    monkeypatch.setattr(Engine, "abort", lambda self, rid: (_ for _ in ()).throw(RuntimeError("abort broke")))
    with serve_in_thread(app) as url:
        rest = _second_after_first_leaves(url, body)   # the first's abort raises on the engine thread
        events = [line for line in rest if line.startswith("data: ")]
        assert '"message": "internal error: engine failure: abort broke"' in events[-1], events[-3:]
        monkeypatch.setattr(Engine, "abort", real_abort)
        health = httpx.get(url + "/health").json()
        assert health == {"status": "ok", "running": 0, "queued": 0}, health
        done = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert done.status_code == 200, done.text
        engine = app.state.engine
        engine._stop = True
        engine._wake.set()
        engine._thread.join(timeout=10)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine stopped"


def test_a_stream_whose_client_leaves_while_queued_gives_its_place_up():
    """Found by a hostile pass: a streamed request was watched for its client's disconnect only once its response
    had started, at its first event; one whose client gave up while it waited kept its queue place (the next
    client got 429) and was then prefilled and stepped for no one. Whole replies were already watched."""
    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    app = _slow_app(tok.encode("some text ") * 100, config, tok, max_batch_size=1)
    app.state.engine.max_waiting = 1
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, **THINK_OFF}
    with serve_in_thread(app) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "max_tokens": 900, "stream": True},
                          timeout=60) as held:
            lines = held.iter_lines()   # kept: a dropped iterator would close the stream
            next(lines)
            for stream in (False, True):
                with pytest.raises(httpx.TimeoutException):   # queued behind the held stream: the client gives up
                    with httpx.stream("POST", url + "/v1/chat/completions",
                                      json={**chat, "max_tokens": 5, "stream": stream}, timeout=0.5) as r:
                        r.read()
                deadline = time.time() + 10
                while httpx.get(url + "/health").json()["queued"] and time.time() < deadline:
                    time.sleep(0.05)
                assert httpx.get(url + "/health").json() == {"status": "ok", "running": 1, "queued": 0}, stream


def test_a_request_larger_than_the_batch_and_the_queue_is_a_400_naming_the_limit():
    """Found by a hostile pass: its sequences are queued one by one, so 64 prompts x n=2 on the default server
    (32 + 64) got 429 "retry later" on an idle server, every time. A request that fits is served."""
    from fastapi.testclient import TestClient

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    app = build_app(TextScriptModel(tok.encode("some text"), config), tok, ServerConfig(model_name="m", max_waiting=1),
                    max_batch_size=2, generation_defaults={"algorithm": "ar"})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **THINK_OFF}
    with TestClient(app) as http:
        for path, body, param in (("/v1/chat/completions", {**chat, "n": 4}, "n"),
                                  ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 2}, "n"),
                                  ("/v1/completions", {"model": "m", "prompt": ["a"] * 4, "max_tokens": 2}, "prompt")):
            r = http.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "asks for 4 sequences" in error["message"]
            assert "at most 3 at once (--max-batch-size 2 + --max-queue 1)" in error["message"]
        assert http.post("/v1/chat/completions", json={**chat, "n": 3}).status_code == 200
        assert http.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 3, "max_tokens": 2}).status_code == 200


def test_a_client_that_hangs_up_before_a_whole_reply_stops_its_generation(server):
    url, client = server
    before = _metric(url, "clover_requests_aborted_total")
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], **THINK_OFF}),
                       ("/v1/completions", {"prompt": "go"})):
        with pytest.raises(httpx.TimeoutException):   # not streamed: the client gives up waiting
            httpx.post(url + path, json={"model": "debug", "max_tokens": 900, "ignore_eos": True, "threshold": 1.0,
                                         **body}, timeout=0.5)
        deadline = time.time() + 10
        while time.time() < deadline and httpx.get(url + "/health").json()["running"]:
            time.sleep(0.05)
        assert httpx.get(url + "/health").json()["running"] == 0
    assert _metric(url, "clover_requests_aborted_total") >= before + 2
    t0 = time.time()
    client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert time.time() - t0 < 10


def _metrics(url):
    """{(sample name, labels without model_name): value}; every sample carries model_name="debug"."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == "debug", s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def _metric(url, name, **labels):
    return _metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_use_vllms_names_and_count_a_request(server):
    """One streamed request of 20 tokens moves vLLM's counters and histograms by what it did (Prometheus
    text parsed by prometheus_client; a model_name label on every sample)."""
    url, client = server
    before = _metrics(url)
    stream = client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "count"}],
                                            max_tokens=20, stream=True, extra_body={"ignore_eos": True, **THINK_OFF})
    assert sum(1 for _ in stream) > 1
    httpx.post(url + "/v1/chat/completions", json={"model": "debug", "messages": []})   # a 400
    after = _metrics(url)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("vllm:generation_tokens_total") == 20
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") == 19        # every token after the first
    assert moved("vllm:request_generation_tokens_sum") == 20
    assert moved("vllm:request_queue_time_seconds_count") == 1
    assert moved("vllm:prompt_tokens_total") >= 1 and moved("clover_nfe_total") >= 1
    assert moved("clover_request_tpf_count") == 1 and moved("clover_requests_total") == 1
    assert moved("clover_http_errors_total", status="400") == 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "clover_engine_steps_total",
                 "clover_prefix_cache_hits_total", "clover_prefix_cache_tokens_reused_total",
                 "clover_prefix_cache_bytes", "clover_prefix_cache_blocks", "clover_prefix_cache_gdn_states",
                 "clover_drafts_accepted_total", "clover_lookup_drafts_accepted_total",
                 "clover_requests_rejected_total"):
        assert any(k[0] == name for k in after), name


def test_a_cache_salt_keeps_prefixes_apart_and_a_bad_one_is_a_400(server):
    """vLLM's `cache_salt`: the same conversation under another salt reuses none of the first's blocks, under the
    same salt it does; an empty or non-string salt is a 400 naming the field (the salt is not echoed)."""
    url, client = server
    messages = [{"role": "system", "content": "Salted system prompt for a tenant. " * 10},
                {"role": "user", "content": "Name three colours."}]
    cached = []
    for salt in ("tenant-1", "tenant-2", "tenant-1"):
        reply = client.chat.completions.create(model="debug", messages=messages, max_tokens=4,
                                               extra_body={"ignore_eos": True, "cache_salt": salt})
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == cached[1] == 0 and cached[2] > 0
    reset = httpx.post(url + "/reset_prefix_cache").json()   # vLLM's route: every cached prefix dropped
    assert reset["reset"] and reset["blocks_dropped"] > 0 and reset["bytes_dropped"] > 0
    again = client.chat.completions.create(model="debug", messages=messages, max_tokens=4,
                                           extra_body={"ignore_eos": True, "cache_salt": "tenant-1"})
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    for bad in ("", 7, "x" * 1025):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert (bad if isinstance(bad, str) and bad else "xxxxxxxx") not in r.text


def test_a_repeated_conversation_reuses_its_prefix_and_answers_the_same(server):
    url, client = server
    system = "You are a careful assistant. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name three colours."}]
    body = dict(model="debug", messages=messages, max_tokens=12, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**body)
    again = client.chat.completions.create(**body)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 8 == 0
    # other questions after the same system prompt: its blocks are cached (K/V), GDN states only every 16th block and
    # at the first prompt's end, so the first such request may prefill some again, keeping the states where its
    # lookup stopped; the next restores the whole shared system prompt
    other = [client.chat.completions.create(**{**body, "messages": [messages[0], {"role": "user", "content": q}]})
             for q in ("Hi", "Hello there")]
    assert other[1].usage.prompt_tokens_details.cached_tokens >= 64
    # the next turn: with thinking off the first prompt ends in an empty think block that the next one does not
    # render, so they part just after the last turn's <|im_start|>; the model's state was kept at the last block
    # boundary before it, and the next turn restores every block up to there
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    body_off = {**body, "extra_body": {**body["extra_body"], **off}}
    reply = client.chat.completions.create(**{**body_off, "messages": [messages[0], {"role": "user", "content": "Why?"}]})
    turn2 = [messages[0], {"role": "user", "content": "Why?"},
             {"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "And?"}]
    follow = client.chat.completions.create(**{**body_off, "messages": turn2})
    tokens = httpx.post(url + "/tokenize", json={"messages": turn2[:2], **off}).json()["tokens"]
    starts = [i for i, t in enumerate(tokens) if t == tokens[0]]   # (the prompt opens with <|im_start|>)
    assert follow.usage.prompt_tokens_details.cached_tokens == starts[-1] // 8 * 8 > 64


# -- tool calls, over a scripted model -----------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
CALLS = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
         "2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
         "</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tool_server():
    tok = Tokenizer.train(["The weather in Paris and Rome. I will check the city days."] * 20, vocab_size=300)
    config = CloverConfig.preset("debug", vocab_size=300, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    model = TextScriptModel(tok.encode(CALLS), config)
    app = build_app(model, tok, ServerConfig(model_name="scripted"), generation_defaults={"algorithm": "ar"})
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_tool_calls_not_streamed(tool_server):
    r = tool_server.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                            tools=TOOLS, max_tokens=200, extra_body=THINK_OFF)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 2}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_tool_calls_streamed_in_the_openai_shape(tool_server):
    chunks = list(tool_server.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=200,
        stream=True, extra_body=THINK_OFF))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    flat = [d for ds in deltas for d in ds]
    assert [d.index for d in flat] == [0, 1] and [d.function.name for d in flat] == ["get_weather"] * 2
    assert json.loads(flat[0].function.arguments) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "I will check."


def test_a_reply_cut_short_after_a_call_says_length(tool_server):
    """max_tokens ends the reply inside its second call: the first call is returned, and finish_reason says
    "length" (as OpenAI's does), not "tool_calls", so that a client can tell the reply was cut."""
    tok = Tokenizer.train(["The weather in Paris and Rome. I will check the city days."] * 20, vocab_size=300)
    cut = len(tok.encode(CALLS[: CALLS.index("Rome")]))
    for stream in (False, True):
        r = tool_server.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                                tools=TOOLS, max_tokens=cut, stream=stream, extra_body=THINK_OFF)
        chunks = list(r) if stream else [r]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == ["length"], stream
        if not stream:
            assert [c.function.name for c in r.choices[0].message.tool_calls][:1] == ["get_weather"]


def test_tool_choice_none_leaves_calls_as_text(tool_server):
    r = tool_server.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                            tools=TOOLS, tool_choice="none", max_tokens=200, extra_body=THINK_OFF)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_scoring_calls_wait_in_the_queue_run_one_per_round_and_are_dropped_when_their_caller_goes():
    """Found by a hostile pass: prompt scoring (/v1/completions with echo and logprobs) skipped the queue (30
    concurrent requests of 64 x 1,000 tokens all admitted, /health saying nothing queued), every pending call
    ran in one round between two steps (a greedy request took 50.6 s instead of 0.17 s), and the calls of
    clients that had left still ran."""
    import asyncio

    from clover.engine.engine import Engine
    from clover.serving.async_engine import AsyncEngine, QueueFull

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    engine = AsyncEngine(Engine(TextScriptModel([5] * 50, config), tok, max_batch_size=1), max_waiting=2)
    ran = []

    async def scenario():   # (the engine thread is not started: this coroutine plays its rounds)
        calls = [asyncio.ensure_future(engine.call(lambda e, i=i: ran.append(i) or i)) for i in range(3)]
        await asyncio.sleep(0)
        assert engine.queue_depth == 3   # one takes the free batch slot's place, two wait: the queue is full
        with pytest.raises(QueueFull, match="queue is full"):
            await engine.call(lambda e: ran.append("refused"))
        later = asyncio.ensure_future(engine.call(lambda e: ran.append("later") or "later", admit=False))
        await asyncio.sleep(0)   # (a request's later calls are not refused)
        calls[1].cancel()        # its client left
        await asyncio.sleep(0)
        for expected in ([0], [0, 2], [0, 2, "later"]):
            engine._round()      # one call per round, the cancelled one skipped
            assert ran == expected
        assert await calls[0] == 0 and await calls[2] == 2 and await later == "later"
        assert engine.queue_depth == 0

    asyncio.run(scenario())
    assert engine.stats.rejected == 1


def test_full_queue_answers_429_and_api_key_is_enforced():
    import asyncio

    from clover.engine.engine import Engine
    from clover.engine.sampling import SamplingParams
    from clover.serving.async_engine import AsyncEngine, QueueFull

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    engine = AsyncEngine(Engine(TextScriptModel([5] * 50, config), tok, max_batch_size=1), max_waiting=1)

    async def scenario():
        # long enough that no request can finish before the scenario closes it (a race on busy machines)
        params = SamplingParams(max_new_tokens=1000, algorithm="ar", ignore_eos=True)
        first = engine.generate([1, 2], params)
        second = engine.generate([1, 2], params)
        third = engine.generate([1, 2], params)
        await first.__anext__()           # running
        s = asyncio.ensure_future(second.__anext__())  # queued
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="queue is full"):
            await third.__anext__()
        await first.aclose()              # a client leaving frees its place
        await s
        await second.aclose()

    engine.start()
    try:
        asyncio.run(scenario())
    finally:
        engine.stop(timeout=5)
    assert engine.stats.rejected == 1 and engine.stats.aborted == 2

    # a burst fills free batch slots before the queue: 4 slots and no queue take 4 at once, refuse a 5th
    burst = AsyncEngine(Engine(TextScriptModel([5] * 50, config), tok, max_batch_size=4), max_waiting=0)

    async def all_at_once():
        params = SamplingParams(max_new_tokens=1000, algorithm="ar", ignore_eos=True)
        streams = [burst.generate([1, 2], params) for _ in range(5)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        done = await asyncio.gather(*firsts, return_exceptions=True)
        for s in streams:
            await s.aclose()
        return done

    burst.start()
    try:
        done = asyncio.run(all_at_once())
    finally:
        burst.stop(timeout=5)
    assert [isinstance(d, QueueFull) for d in done] == [False] * 4 + [True]

    from fastapi.testclient import TestClient

    app = build_app(TextScriptModel([5] * 5, config), tok, ServerConfig(model_name="m", api_key="sekrit"))
    with TestClient(app) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == \
            "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert http.get("/health").status_code == 200  # probes need no key
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 401   # the tokenizer needs it
        assert http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekrit"}).status_code \
            == 200
        assert http.post("/reset_prefix_cache").status_code == 401                # so does dropping the cache
        off = http.post("/reset_prefix_cache", headers={"Authorization": "Bearer sekrit"})
        assert off.status_code == 400 and "prefix cache is off" in off.json()["error"]["message"]
    app = build_app(TextScriptModel([5] * 500, config), tok, ServerConfig(model_name="m", max_waiting=0,
                                                                          max_body_bytes=2000), max_batch_size=1)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve_in_thread(app) as base:   # a real server: TestClient would read the held stream to its end
        with httpx.stream("POST", base + "/v1/chat/completions", json={
                **chat, "max_tokens": 490, "stream": True, "ignore_eos": True, "algorithm": "ar"}, timeout=60) as held:
            lines = held.iter_lines()          # kept: a dropped iterator would close the stream
            next(lines)                        # the one batch slot is taken and there is no queue
            busy = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    app = build_app(TextScriptModel([5] * 5, config), tok, ServerConfig(model_name="m", max_body_bytes=2000))
    with TestClient(app) as http:
        big = http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "x" * 5000}]})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        chunked = http.post("/v1/chat/completions", content=iter([b"{" + b" " * 1500, b" " * 1500 + b"}"]),
                            headers={"content-type": "application/json"})
        assert chunked.status_code == 413                # no content-length: counted while read
        long_stop = http.post("/v1/chat/completions", json={**chat, "stop": ["y" * 1025]})
        assert long_stop.status_code == 400 and long_stop.json()["error"]["param"] == "stop"


def test_sigterm_lets_an_in_flight_stream_finish(tmp_path):
    import signal

    d = tmp_path / "m"
    assert cli_main(["init", str(d), "--preset", "debug", "--seed", "4"]) == 0
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clover", "serve", "--model", str(d), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, proc)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 120, "stream": True, "ignore_eos": True,
            "threshold": 1.0, **THINK_OFF}
    lines = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line and not lines:
                proc.send_signal(signal.SIGTERM)  # shut down while the request is being decoded
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    finals = [json.loads(x[6:]) for x in lines[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    # uvicorn re-raises the signal after its graceful shutdown: the process ends by SIGTERM, not by a hang
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_bench_serve_reports_latency_percentiles_and_throughput(server):
    from clover.evaluation.bench import bench_serve

    url, _ = server
    for concurrency in (1, 4):
        r = bench_serve(url + "/v1", None, 6, 8, 12, concurrency, None, 1, None, None,
                        {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}, 60.0, 1.0)
        assert r["model"] == "debug" and r["succeeded"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 6 * 12 and r["output_token_throughput"] > 0
        for key in ("ttft_s", "tpot_s", "itl_s", "chunk_gap_s", "e2el_s"):
            assert set(r[key]) == {"mean", "median", "p90", "p99"} and r[key]["median"] is not None
        assert r["ttft_s"]["median"] <= r["e2el_s"]["median"] and r["goodput"] <= r["request_throughput"]
        assert r["tpf"] > 0 and r["nfe_total"] >= 6
    bad = bench_serve(url + "/v1", "nope", 2, 4, 4, 2, None, 0, None, None, {}, None, None)   # (with a warning)
    assert bad["failed"] == 2 and "HTTP 404" in bad["errors"][0]


def test_itl_split_and_percentiles():
    from clover.evaluation.bench import percentiles, split_itl

    # two gaps; the chunks after them carry 3 and 1 tokens of the 4 left (by their text share)
    assert split_itl([0.3, 0.2], [30, 10], 4) == pytest.approx([0.1, 0.1, 0.1, 0.2], abs=1e-12)
    p = percentiles([float(i) for i in range(1, 101)])
    assert p["median"] == 50.5 and p["p90"] == 90.0 and p["p99"] == 99.0 and p["mean"] == 50.5
    assert percentiles([])["mean"] is None


class _FailingModel(TextScriptModel):
    """Writes its script, but the fourth forward pass fails (a lost device, say)."""

    def causal(self, ids, cache, lengths, logits="all", rows=None):
        self.forwards = getattr(self, "forwards", 0) + 1
        if self.forwards > 3:
            raise RuntimeError("device lost")
        return super().causal(ids, cache, lengths, logits, rows)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "some"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_failure_after_the_stream_started_is_an_error_event_shaped_like_an_http_error(path, body):
    from fastapi.testclient import TestClient

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    app = build_app(_FailingModel([5] * 20, config), tok, ServerConfig(model_name="m"),
                    generation_defaults={"algorithm": "ar"})
    with TestClient(app) as http:
        r = http.post(path, json={"model": "m", "max_tokens": 10, "stream": True, **body})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        after = http.post(path, json={"model": "m", "max_tokens": 10, **body})
    assert r.status_code == 200 and "data: [DONE]" not in r.text and "choices" in events[0]
    assert events[-1] == {"error": {"message": "internal error: engine failure: device lost", "type": "server_error",
                                    "param": None, "code": None}}
    assert after.status_code == 500 and after.json() == events[-1]  # the same body as an HTTP error


def test_model_by_id_tokenize_detokenize_and_head_health(server):
    url, client = server
    assert client.models.retrieve("debug").id == "debug"
    missing = httpx.get(url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.head(url + "/health").status_code == 200
    text = "def add(a, b):\n    return a + b"
    tok = httpx.post(url + "/tokenize", json={"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == text
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                               "chat_template_kwargs": {"enable_thinking": False}}).json()
    reply = client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat["count"] == reply.usage.prompt_tokens      # the same rendering the chat endpoint decodes from
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")):
        r = httpx.post(url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)


@pytest.mark.parametrize("name,path,body,param", [
    ("100k-deep JSON", "/v1/chat/completions", "[" * 100_000 + "]" * 100_000, None),
    ("lone surrogate in a message", "/v1/chat/completions",
     '{"model":"m","messages":[{"role":"user","content":"a\\ud800b"}]}', None),
    ("lone surrogate in a prompt", "/v1/completions", '{"model":"m","prompt":"a\\udfffb"}', None),
    ("lone surrogate to tokenize", "/tokenize", '{"prompt":"\\udc00"}', None),
    ("tool required not a list", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}, "required": 5}}}]}), "tools"),
    ("tool property not a schema", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": 5}}}}]}), "tools"),
    ("NaN temperature", "/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"temperature":NaN}',
     "temperature"),
    ("an integer of 5,000 digits", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"x"}],"max_tokens":' + "9" * 5000 + "}", None),
    ("a logit_bias key of 5,000 digits", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"x"}],"logit_bias":{"' + "1" * 5000 + '":1}}', "logit_bias"),
    ("seed beyond 63 bits", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "seed": 2**64}), "seed"),
    ("a prompt holding the mask token", "/v1/completions", json.dumps({"prompt": [5, 9]}), "prompt"),
    ("a grammar longer than compiled", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a" * 300_000}), "guided_regex"),
    # compiles, but the parser's limits fail it at the first token: the request's fault, not a 500
    ("a choice of 3,000 strings", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "guided_choice": [f"choice{i}" for i in range(3_000)]}),
     None),
])
def test_hostile_bodies_get_a_400_not_a_500(name, path, body, param):
    from fastapi.testclient import TestClient

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    app = build_app(TextScriptModel([5] * 5, config), tok, ServerConfig(model_name="m"))
    with TestClient(app) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (name, r.text[:200])


def test_absurd_configs_are_refused_before_allocation():
    for field, value in (("num_hidden_layers", 10**6), ("max_position_embeddings", 10**15), ("vocab_size", 2**40)):
        with pytest.raises(ConfigError, match=field):
            CloverConfig.preset("debug", **{field: value, "layer_types": None})
    with pytest.raises(TokenizerError, match="surrogate"):
        Tokenizer.train(["some text"] * 5, vocab_size=270).encode("a\ud800")


def test_a_stream_cut_by_shutdown_gets_a_final_error_event():
    """Past the grace period, a stream still running ends with an error event (503 server_shutting_down),
    not a silent hang-up. (Each step of the scripted model takes 5 ms, so the 800 tokens outlast the 0.2 s grace
    by seconds: without it the reply could end within the grace on a fast machine, and the test failed.)"""
    from fastapi.testclient import TestClient

    class SlowScript(TextScriptModel):
        def causal(self, *args, **kwargs):
            time.sleep(0.005)
            return super().causal(*args, **kwargs)

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    config = CloverConfig.preset("debug", vocab_size=280, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    app = build_app(SlowScript([5] * 900, config), tok, ServerConfig(model_name="m"))
    engine = app.state.engine
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 800, "stream": True, "ignore_eos": True,
            "algorithm": "ar"}
    events = []
    with TestClient(app) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        events.append(next(lines))
        threading.Thread(target=engine.stop, args=(0.2,)).start()   # the shutdown's grace runs out
        events += [x for x in lines if x]
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "server_shutting_down" and "grace" in last["error"]["message"]


def test_the_in_process_server_answers_without_nagles_delay():
    """serve_in_thread's connections have Nagle's algorithm off (TCP_NODELAY), as `clover serve`'s have:
    with it on, each response's second small write waited ~40 ms for the client's delayed ACK."""
    import gc
    import http.client

    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    with serve_in_thread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        client = http.client.HTTPConnection("127.0.0.1", port)
        client.request("GET", "/ping")
        assert json.loads(client.getresponse().read()) == {"ok": True}
        ours = client.sock.getsockname()
        served = []
        for obj in gc.get_objects():   # type(), not isinstance(): that would touch dead weak proxies among them
            if type(obj) is socket.socket and obj.family == socket.AF_INET and obj.fileno() != -1 \
                    and obj is not client.sock:
                try:
                    if obj.getsockname()[1] == port and obj.getpeername() == ours:
                        served.append(obj)
                except OSError:   # a listening or closed socket has no peer
                    pass
        assert served and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in served)
        client.close()


@pytest.mark.parametrize("body,message", [
    # a value matching no member of a union: what each member wants, at the field the client wrote
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: Input should be a valid string, or a valid list"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop: Input should be a valid string, or a valid list"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "any"},
     "tool_choice: Input should be 'none', 'auto' or 'required', or an object"),
    # one member got further: its problem
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}},
     "tool_choice.function: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0.type: Input should be 'text'"),
    ({"prompt": [1, 2, "a"]}, "prompt.2: Input should be a valid integer"),   # not `prompt.0`: a list[str] problem
    ({"prompt": [[1, "a"]]}, "prompt.0.1: Input should be a valid integer"),
    # keys of a dict are not union members, whatever they look like
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {"Session": 1}}, "metadata.Session: Input should be"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": "x"}}, "logit_bias.-1: Input should be"),
])
def test_union_field_errors_name_the_field_not_pydantics_member(body, message):
    """They read `messages.0.content.str: Input should be a valid string` (a param no client wrote)."""
    from pydantic import ValidationError

    from clover.serving.protocol import ChatRequest, CompletionRequest, validation_message

    with pytest.raises(ValidationError) as exc:
        (CompletionRequest if "prompt" in body else ChatRequest).model_validate(body)
    text, param = validation_message(exc.value)
    assert text.startswith(message) and param == message.split(":")[0]


def test_chat_logprobs_bytes_join_into_the_reply_where_tokens_split_a_character():
    """OpenAI's logprobs `bytes` exist for tokens that hold part of a character (decoded alone, U+FFFD): each
    entry carries its token's own bytes, so they join into the reply's text (found by a review: they were the
    bytes of U+FFFD)."""
    from fastapi.testclient import TestClient

    text = "some é ü 日本 text"
    tok = Tokenizer.train(["some text"] * 20, vocab_size=300)   # no merges over the accented letters: bytes
    config = CloverConfig.preset("debug", vocab_size=300, mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids)
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # some tokens are parts of a character
    app = build_app(TextScriptModel(ids, config), tok, ServerConfig(model_name="m"), generation_defaults={"algorithm": "ar"})
    with TestClient(app) as http:
        for as_ids in (False, True):
            body = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2, **THINK_OFF,
                "return_tokens_as_token_ids": as_ids}).json()
            choice = body["choices"][0]
            entries = choice["logprobs"]["content"]
            assert choice["message"]["content"] == text
            assert bytes(b for e in entries for b in e["bytes"]).decode() == text
            assert all(bytes(t["bytes"]) == tok.token_bytes(int(t["token"].split(":")[1])) if as_ids else True
                       for e in entries for t in e["top_logprobs"])


def test_streamed_completion_text_offsets_are_the_whole_replys():
    """A streamed completion's logprobs give each token the text_offset the whole reply gives it, also where
    text is held back (a character split across tokens, a possible stop string): found by a review, the
    stream counted the text let out so far."""
    from fastapi.testclient import TestClient

    text = "some é ü 日本 text"
    tok = Tokenizer.train(["some text"] * 20, vocab_size=300)
    config = CloverConfig.preset("debug", vocab_size=300, mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids)
    app = build_app(TextScriptModel(tok.encode(text), config), tok, ServerConfig(model_name="m"),
                    generation_defaults={"algorithm": "ar"})
    body = {"prompt": "x", "logprobs": 1, "echo": True, "stop": ["日本 tex!"]}
    with TestClient(app) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == "x" + text


def test_vllm_sampling_fields_are_taken():
    """Found by a hostile pass (session 55): stop_token_ids (which the engine had), min_p,
    include_stop_str_in_output, best_of, skip_special_tokens and top_k -1 were refused as unknown or out of
    range, breaking vLLM clients."""
    from fastapi.testclient import TestClient

    text = "alpha beta gamma delta epsilon"
    tok = Tokenizer.train([text] * 20, vocab_size=300)
    config = CloverConfig.preset("debug", vocab_size=300, mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids)
    ids = tok.encode(text)
    app = build_app(TextScriptModel(ids, config), tok, ServerConfig(model_name="m"), generation_defaults={"algorithm": "ar"})
    chat = {"messages": [{"role": "user", "content": "x"}], **THINK_OFF}
    with TestClient(app) as http:
        def reply(**fields):
            r = http.post("/v1/chat/completions", json={**chat, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]
        assert reply(stop=[" gamma"])["message"]["content"] == "alpha beta"
        assert reply(stop=[" gamma"], include_stop_str_in_output=True)["message"]["content"] == "alpha beta gamma"
        k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
        cut = reply(stop_token_ids=[ids[k]])
        assert cut["finish_reason"] == "stop" and cut["message"]["content"] == tok.decode(ids[:k])
        assert reply(min_p=0.5, top_k=-1, best_of=1, skip_special_tokens=False, spaces_between_special_tokens=True,
                     temperature=0.7, seed=1)["message"]["content"] == text   # (a script: one token allowed)
        r = http.post("/v1/chat/completions", json={**chat, "best_of": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        r = http.post("/v1/chat/completions", json={**chat, "min_p": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p"
        # a grammar that matches no text is found only when it is built: its 400 names the field too (was null)
        for field, grammar in (("guided_grammar", "start: start"), ("guided_json", {"$ref": "#"})):
            r = http.post("/v1/chat/completions", json={**chat, field: grammar})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
