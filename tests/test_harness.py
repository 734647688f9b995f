"""The agent harness against scripted OpenAI endpoints: an oracle (100%) and broken ones (0%, with the
right termination reasons), and a killed-then-resumed run that matches an uninterrupted one."""

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from clover import harness


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(messages):
    """The task whose prompt these messages start with, and the next reference assistant turn."""
    for suite in ("tools", "memory"):
        for ht in harness.suite_tasks(suite, 12):
            prompt = ht.task.prompt_messages
            if [m["content"] for m in messages[: len(prompt)]] == [m["content"] for m in prompt]:
                turns = [m for m in ht.task.messages if m["role"] == "assistant"]
                return ht, turns[sum(m["role"] == "assistant" for m in messages)]
    raise AssertionError("unknown task")


def scripted_app(mode):
    app = FastAPI()
    calls = {"n": 0}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        calls["n"] += 1
        if mode == "error":
            return JSONResponse({"error": {"message": "bad", "type": "x", "param": None, "code": None}}, 400)
        if mode == "down":
            return JSONResponse({"error": {"message": "down", "type": "x", "param": None, "code": None}}, 503)
        ht, turn = _reference(body["messages"])
        content = turn.get("content") or ""
        calls_out = [dict(c, id=f"c{i}") for i, c in enumerate(turn.get("tool_calls") or [])]
        if mode == "wrong" and not calls_out:
            content = "I do not know."
        if mode == "malformed" and calls_out:
            calls_out[0] = {**calls_out[0], "function": {**calls_out[0]["function"], "arguments": "{not json"}}

        def sse():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': content}}]})}\n\n"
            if calls_out:
                tcs = [{"index": i, **c} for i, c in enumerate(calls_out)]
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'tool_calls': tcs}}]})}\n\n"
            fin = "tool_calls" if calls_out else "stop"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': fin}]})}\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "nfe": 3}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app, calls


@pytest.fixture
def endpoint():
    servers = []

    def start(mode):
        app, calls = scripted_app(mode)
        port = _port()
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=srv.run, daemon=True).start()
        servers.append(srv)
        deadline = time.time() + 20
        while not srv.started and time.time() < deadline:
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}/v1", calls

    yield start
    for s in servers:
        s.should_exit = True


def _cfg(url, **kw):
    return harness.HarnessConfig(endpoint=url, model="m", tasks_per_suite=6, runs=2, infra_retries=1,
                                 conditions=[{"algorithm": "ar"}, {"algorithm": "low_confidence", "block_size": 32}],
                                 **kw)


def test_oracle_endpoint_solves_every_suite(endpoint, tmp_path):
    url, _ = endpoint("oracle")
    summary = harness.run_harness(_cfg(url), tmp_path / "run")
    for cond in summary.values():
        assert cond["success_mean"] == 1.0 and cond["pass@2"] == 1.0 and cond["pass^2"] == 1.0
        assert cond["by_suite"] == {"memory": 1.0, "tools": 1.0} and cond["valid_tool_arg_rate"] == 1.0
        assert cond["reasons"]["success"] == 24
    results = [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    faulty = [r for r in results if "calc_faulty" in r["task"]]
    assert faulty and all(r["success"] and r["steps"] == 4 for r in faulty)  # noticed the wrong result, recomputed
    memory32 = [r for r in results if r["task"].startswith("memory-32-")]
    assert memory32 and all(r["steps"] == 33 for r in memory32)
    for name in ("metadata.json", "summary.json", "report.md", "latency_layers.png", "success_vs_time.png",
                 "dispersion.png"):
        assert (tmp_path / "run" / name).is_file(), name
    transcript = json.loads(next((tmp_path / "run" / "tasks").rglob("run0.json")).read_text())
    assert transcript["transcript"][0]["role"] in ("user", "system") and transcript["steps"][0]["model_s"] > 0
    assert "| algorithm=ar |" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.parametrize("mode,reason", [("wrong", "wrong_answer"), ("malformed", "invalid_tool_call"),
                                         ("error", "model_error"), ("down", "infrastructure_error")])
def test_broken_endpoints_score_zero_with_the_right_reason(endpoint, tmp_path, mode, reason):
    url, calls = endpoint(mode)
    cfg = _cfg(url, suites=("tools",))
    cfg.tasks_per_suite, cfg.runs, cfg.conditions = 4, 1, [{}]
    summary = harness.run_harness(cfg, tmp_path / "run")["default"]
    assert summary["reasons"][reason] == 4
    if reason == "infrastructure_error":
        assert summary["quality_runs"] == 0 and summary["success_mean"] is None  # left out of quality figures
        assert calls["n"] == 4 * 2  # one retry each
    else:
        assert summary["success_mean"] == 0.0


def test_killed_then_resumed_run_gives_the_same_summary(endpoint, tmp_path):
    url, _ = endpoint("oracle")
    whole = harness.run_harness(_cfg(url), tmp_path / "whole")
    cut = tmp_path / "cut"
    harness.run_harness(_cfg(url), cut)
    lines = (cut / "results.jsonl").read_text().splitlines()
    (cut / "results.jsonl").write_text("\n".join(lines[:17]) + "\n")  # as if killed after 17 task runs
    resumed = harness.run_harness(_cfg(url), cut, resume=True)
    strip = lambda s: {c: {k: v for k, v in d.items() if not k.endswith("_s") and k != "cold_total_s"}  # noqa: E731
                       for c, d in s.items()}
    assert strip(resumed) == strip(whole)
    assert len((cut / "results.jsonl").read_text().splitlines()) == 48
    with pytest.raises(ValueError, match="already holds a run"):
        harness.run_harness(_cfg(url), cut)
