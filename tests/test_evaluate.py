"""Model-card evaluations: the agent loop against an oracle and a broken model, bits per byte."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import perturbed_model

from clover import evaluate, synthetic
from clover.config import CloverConfig
from clover.sampling import SamplingParams
from clover.tokenizer import Tokenizer, stdlib_texts


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(list(stdlib_texts(300_000)), vocab_size=600)


class OracleEngine:
    """Answers each turn with the reference solution's next assistant turn (or a wrong one)."""

    def __init__(self, tok, task, thinking, corrupt=False):
        self.tok, self.task, self.thinking, self.corrupt = tok, task, thinking, corrupt
        self.config = SimpleNamespace(max_position_embeddings=100_000)
        self.turn = 0

    def generate(self, prompts, params):
        msgs = self.task.messages
        idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][self.turn]
        self.turn += 1
        prompt = self.tok.apply_chat_template(msgs[:idx], tools=self.task.tools or None, enable_thinking=self.thinking)
        full = self.tok.apply_chat_template(msgs[: idx + 1], tools=self.task.tools or None, add_generation_prompt=False)
        text = full[len(prompt):].removesuffix("<|im_end|>\n")
        if self.corrupt and not msgs[idx].get("tool_calls"):
            text = text.replace(self.task.answer.split("|")[0], "WRONG")
        return [SimpleNamespace(text=text)]


@pytest.mark.parametrize("family", synthetic.FAMILIES)
@pytest.mark.parametrize("thinking", [True, False])
def test_agent_loop_solves_every_family_with_an_oracle_and_fails_a_broken_one(tok, family, thinking):
    for seed in range(synthetic.SPLIT_SEEDS["test"], synthetic.SPLIT_SEEDS["test"] + 3):
        task = synthetic.make_task(family, seed, thinking=thinking)
        params = SamplingParams()
        good = evaluate.run_agent_task(OracleEngine(tok, task, thinking), tok, task, thinking, params)
        assert good["success"] and good["reason"] == "success", (family, seed, good)
        assert good["malformed"] == 0 and good["steps"] == sum(m["role"] == "assistant" for m in task.messages)
        bad = evaluate.run_agent_task(OracleEngine(tok, task, thinking, corrupt=True), tok, task, thinking, params)
        assert not bad["success"] and bad["reason"] == "wrong_answer"


def test_agent_loop_reports_step_limit_and_invalid_calls(tok):
    task = synthetic.make_task("calc", 1, thinking=False)

    class Looping(OracleEngine):
        def generate(self, prompts, params):
            return [SimpleNamespace(text="<tool_call>\n<function=calculator>\n<parameter=expression>\n1+1\n"
                                         "</parameter>\n</function>\n</tool_call>")]

    class Garbled(OracleEngine):
        def generate(self, prompts, params):
            return [SimpleNamespace(text="<tool_call>\n<function=calculator>\n<parameter=expr")]

    out = evaluate.run_agent_task(Looping(tok, task, False), tok, task, False, SamplingParams(), max_steps=5)
    assert out["reason"] == "step_limit" and out["calls"] == 5
    out = evaluate.run_agent_task(Garbled(tok, task, False), tok, task, False, SamplingParams())
    assert out["reason"] == "invalid_tool_call"


def test_bits_per_byte_matches_a_direct_computation(tok, tmp_path):
    docs = ["def f(x):\n    return x * 2\n", "import os\nprint(os.getcwd())\n"]
    (tmp_path / "raw" / "test").mkdir(parents=True)
    with open(tmp_path / "raw" / "test" / "code.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    config = CloverConfig.preset("debug", vocab_size=640, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    model = perturbed_model(config)
    got = evaluate.bits_per_byte(model, tok, tmp_path, "code", window=4)  # windows shorter than the documents
    nll = 0.0
    with torch.no_grad():
        for d in docs:
            ids = [tok.special_ids["<|endoftext|>"]] + tok.encode(d)
            for s in range(0, len(ids) - 1, 4):
                chunk = torch.tensor([ids[s: s + 5]])
                lp = torch.log_softmax(model(chunk[:, :-1])[0], -1)
                nll -= float(lp[torch.arange(chunk.shape[1] - 1), chunk[0, 1:]].sum())
    n = len("".join(docs).encode())
    assert got["bytes"] == n and abs(got["model_bits_per_byte"] - nll / math.log(2) / n) < 1e-4
    assert 0 < got["xz9_bits_per_byte"] and 0 < got["gzip9_bits_per_byte"]
