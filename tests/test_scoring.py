"""Log-likelihood scoring and logprobs over the OpenAI API (issue 14 item 3): the request shapes
lm-eval sends (echo + logprobs, token-id and batched prompts, max_tokens 0 or 1), chat logprobs for
`ar` and `verify`, and a clear refusal for block diffusion. Every figure is checked against a direct
causal forward of the same model."""

import httpx
import pytest
import torch
from conftest import perturbed_model

from clover.model.config import CloverConfig
from clover.model.tokenizer import Tokenizer, stdlib_texts
from clover.serving.app import ServerConfig, build_app
from clover.serving.local import serve_in_thread

THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    tok = Tokenizer.train(list(stdlib_texts(200_000)), vocab_size=500)
    config = CloverConfig.preset("debug", vocab_size=512, mask_token_id=511, eos_token_id=tok.eos_token_ids)
    model = perturbed_model(config, scale=0.5)
    app = build_app(model, tok, ServerConfig(model_name="m"))   # default algorithm: low_confidence
    with serve_in_thread(app) as url:
        yield url + "/v1", model, tok


def _direct(model, ids):
    """log p(ids[i] | ids[:i]) for i >= 1, and the log-softmax rows that give them."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))], lp


def _post(url, path, body):
    r = httpx.post(url + path, json={"model": "m", **body}, timeout=120)
    return r.status_code, r.json()


def test_loglikelihood_request_of_lm_eval(served):
    """lm-eval's loglikelihood: token ids, echo, logprobs 1, max_tokens 1 (or 0), temperature 0."""
    url, model, tok = served
    ids = tok.encode("def add(a, b):\n    return a + b\n")
    want, lp = _direct(model, ids)
    for max_tokens in (0, 1):
        status, body = _post(url, "/completions", {"prompt": ids, "echo": True, "logprobs": 1,
                                                    "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, body
        got = body["choices"][0]["logprobs"]
        assert got["token_logprobs"][0] is None and len(got["tokens"]) == len(ids) + max_tokens
        assert got["token_logprobs"][1: len(ids)] == pytest.approx(want, abs=1e-4)
        # is_greedy as lm-eval reads it: the top token of each position against the prompt's token
        top = [max(d, key=d.get) for d in got["top_logprobs"][1: len(ids)]]
        assert top == [tok.decode([int(lp[i - 1].argmax())]) for i in range(1, len(ids))]
        assert body["choices"][0]["text"].startswith(tok.decode(ids))
        assert got["text_offset"][:2] == [0, len(tok.decode(ids[:1]))]
    assert body["usage"]["completion_tokens"] == 1


def test_batched_and_text_prompts_are_scored_each(served):
    url, model, tok = served
    texts = ["import os\nprint(os.getcwd())", "x = [i * i for i in range(10)]"]
    status, body = _post(url, "/completions", {"prompt": texts, "echo": True, "logprobs": 3, "max_tokens": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    for text, choice in zip(texts, body["choices"], strict=True):
        want, _ = _direct(model, tok.encode(text))
        assert choice["text"] == text
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        # {token text: logprob}: two ids that decode alike (partial UTF-8 bytes) share a key, as in vLLM
        assert all(1 <= len(d) <= 3 for d in choice["logprobs"]["top_logprobs"][1:])
    status, body = _post(url, "/completions", {"prompt": [tok.encode(t) for t in texts], "max_tokens": 4,
                                                "temperature": 0, "n": 2, "algorithm": "ar"})
    assert status == 200 and len(body["choices"]) == 4 and body["choices"][0]["text"] == body["choices"][1]["text"]


@pytest.mark.parametrize("algorithm", ["ar", "verify", None])
def test_chat_logprobs_are_the_causal_heads(served, algorithm):
    """Each generated token's logprob equals the teacher-forced causal forward over prompt + reply;
    greedy picks the top token; ar and verify (the same tokens) give the same figures, and a request
    that names no algorithm gets a decoder that can give them."""
    url, model, tok = served
    messages = [{"role": "user", "content": "Write a loop."}]
    extra = {"algorithm": algorithm} if algorithm else {}
    status, body = _post(url, "/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                                     "logprobs": True, "top_logprobs": 2, "ignore_eos": True,
                                                     "return_tokens_as_token_ids": True, **THINK_OFF, **extra})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 12
    prompt = tok.encode_chat(messages, enable_thinking=False)
    reply = [int(c["token"].removeprefix("token_id:")) for c in content]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + reply]))[0].float(), -1)
    for i, c in enumerate(content):
        row = lp[len(prompt) - 1 + i]
        row[model.config.mask_token_id] = -torch.inf   # never an output
        row = torch.log_softmax(row, -1)
        assert c["logprob"] == pytest.approx(float(row.max()), abs=1e-4)          # greedy: the top token
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
        assert c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"], abs=1e-6)


def test_streamed_chat_logprobs_equal_the_whole_reply(served):
    url, _, _ = served
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0,
            "logprobs": True, "algorithm": "verify", "ignore_eos": True, **THINK_OFF}
    whole = httpx.post(url + "/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    streamed = []
    with httpx.stream("POST", url + "/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                for ch in json.loads(line[6:])["choices"]:
                    streamed += (ch.get("logprobs") or {}).get("content", [])
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in whole], abs=1e-6)


@pytest.mark.parametrize("body,param,message", [
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "algorithm": "low_confidence"},
     "logprobs", "algorithm 'ar' or 'verify'"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 25}, "top_logprobs",
     "at most 20"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed with stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "add echo"),
    ({"prompt": "x", "logprobs": 50, "echo": True, "max_tokens": 0}, "logprobs", "at most 20"),
    ({"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0, "stream": True}, "stream", "neither streamed"),
    ({"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0, "n": 2}, "n", "nor sampled n times"),
    ({"prompt": [1, 2, 99999], "max_tokens": 2}, "prompt", "outside the vocabulary"),
    ({"prompt": [], "max_tokens": 2}, "prompt", "1 to 64 prompts"),
])
def test_what_cannot_be_scored_is_refused_clearly(served, body, param, message):
    url, _, _ = served
    path = "/chat/completions" if "messages" in body else "/completions"
    status, out = _post(url, path, body)
    assert status == 400 and out["error"]["param"] == param and message in out["error"]["message"], out


def test_a_stop_token_keeps_its_logprob_entry(served):
    """lm-eval reads one entry per generated token: when the one token is end of sequence, its entry is
    still there (as vLLM reports it), so token_logprobs[ctxlen:-1] is the continuation."""
    url, model, tok = served
    ids = tok.encode("x = 1\n")
    eos = tok.eos_token_ids[-1]
    status, body = _post(url, "/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1,
                                                "temperature": 0, "logit_bias": {str(eos): 100}})
    got = body["choices"][0]["logprobs"]
    assert status == 200 and len(got["token_logprobs"]) == len(ids) + 1
    with torch.no_grad():   # the model's own log-probability of it (logprobs are reported before logit_bias)
        row = model(torch.tensor([ids]))[0, -1].float()
    row[model.config.mask_token_id] = -torch.inf
    assert got["token_logprobs"][-1] == pytest.approx(float(torch.log_softmax(row, -1)[eos]), abs=1e-4)
    assert body["choices"][0]["text"] == tok.decode(ids)            # its text is not output
    status, out = _post(url, "/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"²": 1}})
    assert status == 400 and out["error"]["param"] == "logit_bias"


def test_a_prompt_that_fills_the_context_is_scored_and_one_past_it_refused(served):
    """lm-eval's rolling windows reach exactly the context length: scored (found by a hostile pass: refused
    with "the prompt has 1024 tokens but the context limit is 1024 tokens"). A generation from it has no room,
    and one token more cannot be scored."""
    url, model, _ = served
    ctx = model.config.max_position_embeddings
    ids = [(7 * i) % 400 + 20 for i in range(ctx)]
    status, body = _post(url, "/completions", {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 200, body
    want, _ = _direct(model, ids)
    assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    status, body = _post(url, "/completions", {"prompt": ids, "max_tokens": 1})
    assert status == 400 and "which leaves no room for a reply" in body["error"]["message"]
    status, body = _post(url, "/completions", {"prompt": ids + [20], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_completions_default_to_16_tokens_and_null_means_the_default(served):
    """A /v1/completions request without max_tokens gets 16 tokens (OpenAI's and vLLM's default, not a chat
    reply's 512); fields sent as null (the openai client sends `n=None` so) take their defaults."""
    url, _, _ = served
    status, body = _post(url, "/completions", {"prompt": "def", "ignore_eos": True, "n": None, "stream": None,
                                                "echo": None, "min_tokens": None})
    assert status == 200 and body["usage"]["completion_tokens"] == 16 and len(body["choices"]) == 1, body
    status, body = _post(url, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                     "logprobs": None, "n": None, **THINK_OFF})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3, body
    status, body = _post(url, "/chat/completions", {"messages": None})
    assert status == 400 and body["error"]["param"] == "messages", body   # a required field stays required
