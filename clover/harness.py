"""`clover eval agent`: a fixed agent loop over any OpenAI-compatible endpoint, following the
reproducible-evaluation checklist of the seed article (same prompts, tools, timeouts, step limit and
retry policy for every model; several runs; cold and warm; sweeps; dispersion, not best attempts).

Suites (task families from `clover.synthetic`, test seeds only, never training ones):
- `tools`:  multi-step calculator, notes and virtual-file-system tasks, plus tasks whose first
            calculator result is wrong (the tool misbehaves once) and must be noticed;
- `memory`: an early instruction / fact that must hold after 2, 8 and 32 tool results.

Per step: model time, TTFT (streaming), tokens, tool time, harness overhead. Per task: total time,
steps, success, termination reason (success, wrong_answer, step_limit, timeout, invalid_tool_call,
model_error, infrastructure_error), valid-tool-argument rate. Infrastructure failures are retried
a bounded number of times, labelled, and left out of quality figures. A run directory holds
metadata.json, one transcript per task run, results.jsonl, summary.json, report.md and PNG plots;
`--resume` skips the task runs already in results.jsonl.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clover import synthetic

REASONS = ("success", "wrong_answer", "step_limit", "timeout", "invalid_tool_call", "model_error",
           "infrastructure_error")
MEMORY_STEPS = (2, 8, 32)


@dataclass
class HarnessConfig:
    endpoint: str
    model: str
    suites: tuple[str, ...] = ("tools", "memory")
    tasks_per_suite: int = 10
    runs: int = 3
    conditions: list[dict] = field(default_factory=lambda: [{}])   # extra body fields per condition
    step_limit: int = 40   # memory tasks need up to 33 turns
    task_timeout_s: float = 300.0
    request_timeout_s: float = 120.0
    max_tokens: int = 256
    infra_retries: int = 2
    thinking: bool = False
    api_key: str | None = None


# -- tasks ------------------------------------------------------------------------------------------------


@dataclass
class HarnessTask:
    id: str
    suite: str
    task: synthetic.Task
    faulty_first_call: bool = False   # the first calculator result is wrong and must be noticed


def suite_tasks(suite: str, count: int) -> list[HarnessTask]:
    base = synthetic.SPLIT_SEEDS["test"] + 500_000  # test-range seeds the model card's evaluation does not use
    out = []
    if suite == "tools":
        fams = ("calc", "notes", "files", "calc_faulty")
        for i in range(count):
            fam = fams[i % len(fams)]
            seed = base + i
            if fam == "calc_faulty":
                out.append(HarnessTask(f"tools-calc_faulty-{seed}", suite, make_faulty_calc(seed), True))
            else:
                out.append(HarnessTask(f"tools-{fam}-{seed}", suite, synthetic.make_task(fam, seed, thinking=False)))
    elif suite == "memory":
        for i in range(count):
            steps = MEMORY_STEPS[i % len(MEMORY_STEPS)]
            seed = base + 1000 + i
            out.append(HarnessTask(f"memory-{steps}-{seed}", suite,
                                   synthetic.make_task("recall", seed, thinking=False, steps=steps)))
    else:
        raise ValueError(f"unknown suite {suite!r}; choose from tools, memory")
    return out


def make_faulty_calc(seed: int) -> synthetic.Task:
    """A calc task whose first calculator answer is off by 1000: the reference solution checks it
    by recomputing before going on (the harness injects the fault into the real tool)."""
    task = synthetic.make_task("calc", seed, thinking=False)
    msgs = [dict(m) for m in task.messages]
    first_call = next(i for i, m in enumerate(msgs) if m.get("tool_calls"))
    expr = json.loads(msgs[first_call]["tool_calls"][0]["function"]["arguments"])["expression"]
    right = synthetic.calculate(expr)
    wrong = str(int(float(right)) + 1000) if right.lstrip("-").isdigit() else right + "0"
    msgs[first_call + 1] = {"role": "tool", "content": wrong}
    recheck = {"role": "assistant", "content": f"{expr} cannot be {wrong}; let me recompute.",
               "tool_calls": [synthetic._call("calculator", expression=expr)]}
    msgs[first_call + 2:first_call + 2] = [recheck, {"role": "tool", "content": right}]
    return synthetic.Task("calc_faulty", seed, task.tools, msgs, task.answer, task.check, thinking=False,
                          initial_files=task.initial_files)


class FaultyWorld(synthetic.World):
    """The calculator gets the first computation wrong by 1000, then behaves."""

    def __init__(self) -> None:
        super().__init__()
        self.faulted = False

    def call(self, name: str, args: dict[str, Any]) -> str:
        result = super().call(name, args)
        if name == "calculator" and not self.faulted and not result.startswith("error"):
            self.faulted = True
            return str(int(float(result)) + 1000) if result.lstrip("-").isdigit() else result + "0"
        return result


# -- the loop ----------------------------------------------------------------------------------------------


class InfraError(RuntimeError):
    """The endpoint could not be reached or answered nonsense (not the model's fault)."""


class ModelError(RuntimeError):
    """The endpoint answered with an error status for a well-formed request."""


def _chat(client: httpx.Client, cfg: HarnessConfig, body: dict) -> dict:
    """One streamed chat completion; returns message, usage and timings."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    t0 = time.perf_counter()
    ttft = None
    content, reasoning, calls, usage, finish = "", "", {}, {}, None
    try:
        with client.stream("POST", cfg.endpoint.rstrip("/") + "/chat/completions", json=body, headers=headers,
                           timeout=cfg.request_timeout_s) as r:
            if r.status_code >= 500 or r.status_code == 429:
                raise InfraError(f"HTTP {r.status_code}")
            if r.status_code != 200:
                raise ModelError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise ModelError(str(data["error"])[:200])
                usage = data.get("usage") or usage
                for ch in data.get("choices", []):
                    d = ch.get("delta", {})
                    piece = (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
                    for tc in d.get("tool_calls") or []:
                        slot = calls.setdefault(tc.get("index", 0), {"id": tc.get("id"), "name": "", "arguments": ""})
                        fn = tc.get("function") or {}
                        slot["name"] += fn.get("name") or ""
                        slot["arguments"] += fn.get("arguments") or ""
                        piece += fn.get("arguments") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    content += d.get("content") or ""
                    reasoning += d.get("reasoning_content") or d.get("reasoning") or ""
                    finish = ch.get("finish_reason") or finish
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        raise InfraError(f"{type(exc).__name__}: {exc}") from exc
    return {"content": content, "reasoning": reasoning, "tool_calls": [calls[k] for k in sorted(calls)],
            "usage": usage, "finish_reason": finish, "model_s": time.perf_counter() - t0, "ttft_s": ttft}


def run_task(client: httpx.Client, cfg: HarnessConfig, ht: HarnessTask, condition: dict) -> dict:
    """One attempt at one task under one condition; the transcript records every step."""
    task = ht.task
    world = FaultyWorld() if ht.faulty_first_call else task.fresh_world()
    messages = [dict(m) for m in task.prompt_messages]
    steps, transcript = [], []
    valid_args = total_args = 0
    t_start = time.perf_counter()
    reason = "step_limit"
    answer = None
    for step in range(cfg.step_limit):
        if time.perf_counter() - t_start > cfg.task_timeout_s:
            reason = "timeout"
            break
        t_step = time.perf_counter()
        body = {"model": cfg.model, "messages": messages, "tools": task.tools or None, "max_tokens": cfg.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": cfg.thinking}, **condition}
        if not task.tools:
            body.pop("tools")
        try:
            reply = _chat(client, cfg, body)
        except ModelError as exc:
            steps.append({"step": step, "error": str(exc)})
            reason = "model_error"
            break
        tool_s = 0.0
        record = {"step": step, "model_s": reply["model_s"], "ttft_s": reply["ttft_s"],
                  "completion_tokens": (reply["usage"] or {}).get("completion_tokens"),
                  "nfe": (reply["usage"] or {}).get("nfe"), "finish_reason": reply["finish_reason"],
                  "content": reply["content"][:500], "tool_calls": reply["tool_calls"]}
        if reply["tool_calls"]:
            messages.append({"role": "assistant", "content": reply["content"] or None, "tool_calls": [
                {"id": c["id"] or f"call_{step}_{i}", "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for i, c in enumerate(reply["tool_calls"])]})
            bad = False
            for c in reply["tool_calls"]:
                total_args += 1
                t_tool = time.perf_counter()
                try:
                    args = json.loads(c["arguments"] or "{}")
                    ok = isinstance(args, dict) and c["name"] in {t["function"]["name"] for t in task.tools}
                except json.JSONDecodeError:
                    args, ok = {}, False
                result = world.call(c["name"], args) if ok else "error: invalid tool call"
                valid_args += ok
                bad |= not ok
                tool_s += time.perf_counter() - t_tool
                messages.append({"role": "tool", "tool_call_id": c["id"] or "", "content": result})
            record["tool_s"] = tool_s
            record["harness_s"] = time.perf_counter() - t_step - reply["model_s"] - tool_s
            steps.append(record)
            if bad:
                reason = "invalid_tool_call"
                break
            continue
        record["tool_s"] = 0.0
        record["harness_s"] = time.perf_counter() - t_step - reply["model_s"]
        steps.append(record)
        answer = reply["content"]
        reason = "success" if task.check(answer) else "wrong_answer"
        break
    transcript = messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])
    model_s = sum(s.get("model_s", 0) for s in steps)
    tool_s = sum(s.get("tool_s", 0) for s in steps)
    return {"reason": reason, "success": reason == "success", "steps": len(steps),
            "total_s": time.perf_counter() - t_start, "model_s": model_s, "tool_s": tool_s,
            "harness_s": sum(s.get("harness_s", 0) for s in steps),
            "ttft_s": [s["ttft_s"] for s in steps if s.get("ttft_s") is not None],
            "valid_tool_args": valid_args, "tool_calls": total_args, "step_records": steps, "transcript": transcript}


def _condition_name(condition: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(condition.items())) or "default"


def run_harness(cfg: HarnessConfig, out: str | Path, resume: bool = False) -> dict:
    out = Path(out)
    results_path = out / "results.jsonl"
    done = set()
    if resume and results_path.is_file():
        for line in results_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done.add((r["task"], r["condition"], r["run"]))
    elif results_path.exists():
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metadata.json").write_text(json.dumps(_metadata(cfg), indent=2) + "\n")
    tasks = [t for s in cfg.suites for t in suite_tasks(s, cfg.tasks_per_suite)]
    first_request = not done  # the cold condition: the first request this harness sends
    with httpx.Client() as client:
        for run in range(cfg.runs):
            for condition in cfg.conditions:
                cname = _condition_name(condition)
                for ht in tasks:
                    if (ht.id, cname, run) in done:
                        continue
                    for attempt in range(cfg.infra_retries + 1):
                        try:
                            res = run_task(client, cfg, ht, condition)
                            break
                        except InfraError as exc:
                            res = {"reason": "infrastructure_error", "success": False, "error": str(exc),
                                   "steps": 0, "total_s": 0.0, "model_s": 0.0, "tool_s": 0.0, "harness_s": 0.0,
                                   "ttft_s": [], "valid_tool_args": 0, "tool_calls": 0, "step_records": [],
                                   "transcript": []}
                            time.sleep(min(2 ** attempt, 10))
                    res.update(task=ht.id, suite=ht.suite, condition=cname, run=run, cold=first_request,
                               attempts=attempt + 1)
                    first_request = False
                    tdir = out / "tasks" / ht.id / cname
                    tdir.mkdir(parents=True, exist_ok=True)
                    (tdir / f"run{run}.json").write_text(json.dumps(
                        {"transcript": res.pop("transcript"), "steps": res.pop("step_records")}, indent=1))
                    with open(results_path, "a") as f:
                        f.write(json.dumps(res) + "\n")
    results = [json.loads(x) for x in results_path.read_text().splitlines() if x.strip()]
    summary = summarise(results, cfg.runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(out, cfg, summary, results)
    return summary


def _metadata(cfg: HarnessConfig) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    import torch

    return {"commit": commit, "endpoint": cfg.endpoint, "model": cfg.model, "suites": list(cfg.suites),
            "tasks_per_suite": cfg.tasks_per_suite, "runs": cfg.runs, "conditions": cfg.conditions,
            "step_limit": cfg.step_limit, "task_timeout_s": cfg.task_timeout_s, "max_tokens": cfg.max_tokens,
            "thinking": cfg.thinking, "infra_retries": cfg.infra_retries, "python": platform.python_version(),
            "torch": torch.__version__, "httpx": httpx.__version__, "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


# -- statistics and report ---------------------------------------------------------------------------------


def _dist(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p90": None, "min": None, "max": None}
    s = sorted(values)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))],
            "min": s[0], "max": s[-1]}


def summarise(results: list[dict], runs: int) -> dict:
    out = {}
    for cname in sorted({r["condition"] for r in results}):
        rows = [r for r in results if r["condition"] == cname]
        quality = [r for r in rows if r["reason"] != "infrastructure_error"]
        n = len(quality)
        p = sum(r["success"] for r in quality) / n if n else None
        by_task: dict[str, list[bool]] = {}
        for r in quality:
            by_task.setdefault(r["task"], []).append(r["success"])
        reasons = {k: sum(r["reason"] == k for r in rows) for k in REASONS}
        calls = sum(r["tool_calls"] for r in quality)
        out[cname] = {
            "task_runs": len(rows), "quality_runs": n, "success_mean": p,
            "success_stderr": math.sqrt(p * (1 - p) / n) if n and p is not None else None,
            f"pass@{runs}": (sum(any(v) for v in by_task.values()) / len(by_task)) if by_task else None,
            f"pass^{runs}": (sum(all(v) for v in by_task.values()) / len(by_task)) if by_task else None,
            "reasons": reasons, "valid_tool_arg_rate": (sum(r["valid_tool_args"] for r in quality) / calls)
            if calls else None,
            "model_s": _dist([r["model_s"] for r in quality]), "tool_s": _dist([r["tool_s"] for r in quality]),
            "harness_s": _dist([r["harness_s"] for r in quality]), "total_s": _dist([r["total_s"] for r in quality]),
            "ttft_s": _dist([t for r in quality for t in r["ttft_s"]]),
            "cold_total_s": [r["total_s"] for r in rows if r.get("cold")],
            "by_suite": {s: sum(r["success"] for r in quality if r["suite"] == s) /
                         max(1, sum(1 for r in quality if r["suite"] == s))
                         for s in sorted({r["suite"] for r in quality})},
        }
    return out


def write_report(out: Path, cfg: HarnessConfig, summary: dict, results: list[dict]) -> None:
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["# Agent evaluation report", "", f"Endpoint `{cfg.endpoint}`, model `{cfg.model}`, suites "
             f"{', '.join(cfg.suites)} ({cfg.tasks_per_suite} tasks each), {cfg.runs} runs per task and condition, "
             f"step limit {cfg.step_limit}, max_tokens {cfg.max_tokens}, thinking {'on' if cfg.thinking else 'off'}, "
             "temperature 0. Conditions and metadata: `metadata.json`.", "",
             "| condition | task runs | success (± s.e.) | pass@k | pass^k | valid tool args | model s (median / p90) "
             "| tool s (median) | total s (median / p90, min-max) | TTFT s (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    k = cfg.runs
    for cname, s in summary.items():
        lines.append(f"| {cname} | {s['task_runs']} | {fmt(s['success_mean'])} ± {fmt(s['success_stderr'])} | "
                     f"{fmt(s[f'pass@{k}'])} | {fmt(s[f'pass^{k}'])} | {fmt(s['valid_tool_arg_rate'])} | "
                     f"{fmt(s['model_s']['median'])} / {fmt(s['model_s']['p90'])} | {fmt(s['tool_s']['median'])} | "
                     f"{fmt(s['total_s']['median'])} / {fmt(s['total_s']['p90'])} ({fmt(s['total_s']['min'])}-"
                     f"{fmt(s['total_s']['max'])}) | {fmt(s['ttft_s']['median'])} |")
    lines += ["", "How task runs ended:", "", "| condition | " + " | ".join(REASONS) + " |",
              "|---|" + "---|" * len(REASONS)]
    for cname, s in summary.items():
        lines.append(f"| {cname} | " + " | ".join(str(s["reasons"][r]) for r in REASONS) + " |")
    lines += ["", "Cold start (the first request this harness sent): " + ", ".join(
        f"{c}: {s['cold_total_s'][0]:.2f} s" for c, s in summary.items() if s["cold_total_s"]) + ".", ""]
    if _plots(out, summary, results):
        lines += ["![latency layers](latency_layers.png)", "", "![success against time](success_vs_time.png)", "",
                  "![dispersion per task](dispersion.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def _plots(out: Path, summary: dict, results: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for layer in ("model_s", "tool_s", "harness_s"):
        vals = [summary[c][layer]["median"] or 0 for c in names]
        ax.bar(names, vals, bottom=bottom, label=layer.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(ylabel="median seconds per task", title="latency layers per condition")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_layers.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in names:
        ax.scatter(summary[c]["total_s"]["median"] or 0, summary[c]["success_mean"] or 0, s=60)
        ax.annotate(c, (summary[c]["total_s"]["median"] or 0, summary[c]["success_mean"] or 0), fontsize=8)
    ax.set(xlabel="median total seconds per task", ylabel="success rate", title="success against time")
    fig.tight_layout()
    fig.savefig(out / "success_vs_time.png", dpi=110)
    plt.close(fig)
    tasks = sorted({r["task"] for r in results})
    fig, ax = plt.subplots(figsize=(max(6, len(tasks) * 0.4), 4))
    for j, c in enumerate(names):
        for i, t in enumerate(tasks):
            ys = [r["total_s"] for r in results if r["task"] == t and r["condition"] == c]
            ax.scatter([i + 0.15 * j] * len(ys), ys, s=12, label=c if i == 0 else None)
    ax.set_xticks(range(len(tasks)), tasks, rotation=80, fontsize=6)
    ax.set(ylabel="total seconds", title="dispersion over runs, per task")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "dispersion.png", dpi=110)
    plt.close(fig)
    return True
