"""`clover eval agent`: a fixed agent loop over any OpenAI-compatible endpoints, following the
reproducible-evaluation checklist of the seed article (same prompts, tools, timeouts, step limit and
retry policy for every model; several runs; cold and warm; sweeps; dispersion, not best attempts).

The suites (`tools`, `memory`, `coding`, `humaneval`) live in `clover.evaluation.suites`. Per step the
loop records model time, TTFT (streamed), tokens, NFE, tool time and harness overhead; per task
run: total time, steps, success, termination reason (success, wrong_answer, step_limit, timeout,
invalid_tool_call, model_error, infrastructure_error, harness_error), valid tool arguments and malformed calls.
Several endpoints and several conditions (extra body fields: algorithm, block size, threshold)
run side by side; the first request to each endpoint is labelled cold. Infrastructure failures are
retried a bounded number of times, labelled, and left out of quality figures, as are failures of the
harness itself (a task run's own: the run goes on). A run directory holds
metadata.json, one transcript per task run, results.jsonl, summary.json, report.md and PNG plots;
`--resume` skips the task runs already in results.jsonl that measured something (those that ended in an
infrastructure or harness error are done again). MAX_INFRA_IN_A_ROW infrastructure errors in a row stop
the run (a server that went down), to be resumed when it is back.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from clover.evaluation.client import (
    EndpointRefused,
    InfraError,
    ModelError,
    OutOfTime,
    StreamedReply,
    is_int,
    list_models,
    stream_chat,
)
from clover.evaluation.suites import Environment, HarnessTask, check_split, check_suite, suite_tasks
from clover.model.files import json_lines, read_text, write_text_atomic

REASONS = ("success", "wrong_answer", "step_limit", "timeout", "invalid_tool_call", "model_error",
           "infrastructure_error", "harness_error")
# the endings that say nothing of the model: left out of quality figures, and done again on --resume
NOT_MEASURED = ("infrastructure_error", "harness_error")
# the request fields the harness sets alike for every condition (`_agent_loop`), and those that would change what
# they set: a condition may not set them (its results would be compared with others' made otherwise)
FIXED_FIELDS = ("model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "n", "stream",
                "stream_options", "temperature", "chat_template_kwargs")
FIXED_FIELDS_HOW = "--model, --max-tokens and --thinking; temperature 0, one streamed reply, the task's tools"
# task runs of an endpoint in a row that end in infrastructure errors (each after its retries) before the run stops:
# the server is down, and the rest of the run would only fill results.jsonl with failures to redo
MAX_INFRA_IN_A_ROW = 5


@dataclass
class Endpoint:
    url: str                    # base URL ending in /v1
    model: str
    name: str = ""              # its label in the report (default: the model name)
    api_key: str | None = None

    def __post_init__(self) -> None:
        self.name = self.name or self.model
        try:
            httpx.URL(self.url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"endpoint URL {self.url!r} is not a valid URL ({exc}); use http://HOST:PORT/v1") from None


@dataclass
class HarnessConfig:
    endpoints: list[Endpoint]
    suites: tuple[str, ...] = ("tools", "memory")
    tasks_per_suite: int | None = None   # None: each suite's default size
    runs: int = 3
    conditions: list[dict] = field(default_factory=lambda: [{}])   # extra body fields per condition
    step_limit: int = 40   # memory tasks need up to 33 turns
    task_timeout_s: float = 300.0
    request_timeout_s: float = 120.0
    max_tokens: int = 256
    infra_retries: int = 2
    infra_backoff_s: float = 1.0   # the wait before retry k (k = 0, 1, ...) is this times 2**k, at most 10 s
    thinking: bool = False
    split: str = "test"   # whose seeds the seeded suites draw: test, or val (to develop a recipe on)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("give at least one endpoint")
        if len({e.name for e in self.endpoints}) != len(self.endpoints):
            raise ValueError("endpoint names must differ; label them with name=URL")
        if not self.infra_backoff_s >= 0:
            raise ValueError("the retry backoff must be a number of seconds >= 0")
        check_split(self.split)
        self.suites = tuple(dict.fromkeys(self.suites))   # (`--suite tools,tools` would run each task twice as often)
        if self.runs < 1 or (self.tasks_per_suite is not None and self.tasks_per_suite < 1) or self.step_limit < 1:
            raise ValueError("runs, tasks per suite and the step limit must be at least 1")
        if not all(isinstance(c, dict) for c in self.conditions):
            raise ValueError("each condition must be a JSON object of extra body fields")
        for c in self.conditions:
            problem = _condition_problem(c)
            if problem:
                raise ValueError(f"condition {json.dumps(c, default=str)}: {problem}")
        names = [self.condition_name(self.endpoints[0], c) for c in self.conditions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:   # (their runs would be pooled under one label, and a resumed run would skip some)
            raise ValueError(f"two conditions have the same label {twice[0]!r}; give each condition other values")
        for suite in self.suites:
            check_suite(suite)

    def condition_name(self, endpoint: Endpoint, condition: dict) -> str:
        name = ",".join(f"{k}={v}" for k, v in sorted(condition.items())) or "default"
        return f"{endpoint.name}: {name}" if len(self.endpoints) > 1 else name


def _condition_problem(condition: dict) -> str | None:
    """What is wrong with a condition (None: nothing): a field the harness fixes (FIXED_FIELDS), or one of Clover's
    decoding fields of the wrong kind (the server would refuse every request, or the report could not order it)."""
    fixed = sorted(set(condition) & set(FIXED_FIELDS))
    if fixed:
        return f"may not set {', '.join(fixed)}: the harness sets them alike for every condition ({FIXED_FIELDS_HOW})"
    if "algorithm" in condition and not (isinstance(condition["algorithm"], str) and condition["algorithm"]):
        return "algorithm must be a name such as \"ar\" or \"low_confidence\""
    for key in ("block_size", "max_accept_per_step"):
        if key in condition and not (is_int(condition[key]) and condition[key] >= 1):
            return f"{key} must be a positive integer (leave it out for the server's default)"
    threshold = condition.get("threshold", 0)
    if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0 <= threshold <= 1):
        return "threshold must be a number between 0 and 1 (leave it out for the server's default)"
    return None


# -- the loop ----------------------------------------------------------------------------------------------


def _malformed(reply: StreamedReply) -> int:
    """Tool-call markup the server could not parse into a call (it leaked into the text)."""
    return int("<tool_call>" in reply.content or "</tool_call>" in reply.content)


def run_task(client: httpx.Client, cfg: HarnessConfig, endpoint: Endpoint, ht: HarnessTask, condition: dict) -> dict:
    """One attempt at one task under one condition; the transcript records every step."""
    env = ht.open()
    try:
        return _agent_loop(client, cfg, endpoint, ht, condition, env)
    finally:
        env.close()


def _agent_loop(client: httpx.Client, cfg: HarnessConfig, endpoint: Endpoint, ht: HarnessTask, condition: dict,
                env: Environment) -> dict:
    messages = [dict(m) for m in ht.prompt]
    tool_names = {t["function"]["name"] for t in ht.tools}
    steps: list[dict] = []
    valid_args = total_args = malformed = 0
    t_start = time.perf_counter()
    if hasattr(env, "set_deadline"):   # (an environment whose tools run programs ends them with the task's time)
        env.set_deadline(t_start + cfg.task_timeout_s)
    reason, answer, check_s = "step_limit", None, 0.0
    for step in range(cfg.step_limit):
        if time.perf_counter() - t_start > cfg.task_timeout_s:
            reason = "timeout"
            break
        t_step = time.perf_counter()
        body = {"model": endpoint.model, "messages": messages, "max_tokens": cfg.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": cfg.thinking}, **condition}
        if ht.tools:
            body["tools"] = ht.tools
        try:
            reply = stream_chat(client, endpoint.url, body, endpoint.api_key, cfg.request_timeout_s,
                                deadline_s=cfg.task_timeout_s - (time.perf_counter() - t_start))
        except ModelError as exc:
            steps.append({"step": step, "error": str(exc)})
            reason = "model_error"
            break
        except OutOfTime as exc:   # (a reply that ends after the task's or request's time must not count)
            steps.append({"step": step, "error": str(exc)})
            reason = "timeout"
            break
        usage = reply.usage
        leaked = _malformed(reply)
        malformed += leaked
        record = {"step": step, "model_s": reply.e2e_s, "ttft_s": reply.ttft_s,
                  "completion_tokens": usage.get("completion_tokens"), "nfe": usage.get("nfe"),
                  "finish_reason": reply.finish_reason, "content": reply.content[:2000],
                  "tool_calls": reply.tool_calls}
        tool_s = 0.0
        if reply.tool_calls:
            for i, c in enumerate(reply.tool_calls):   # (a server that sends no ids: ours, the same in both places)
                c["id"] = c["id"] or f"call_{step}_{i}"
            messages.append({"role": "assistant", "content": reply.content or None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in reply.tool_calls]})
            bad = out_of_time = False
            for c in reply.tool_calls:
                if time.perf_counter() - t_start > cfg.task_timeout_s:   # (one reply may hold many slow calls: the
                    out_of_time = True                                   # task's time is checked before each)
                    break
                total_args += 1
                t_tool = time.perf_counter()
                try:
                    args = json.loads(c["arguments"] or "{}")
                    ok = isinstance(args, dict) and c["name"] in tool_names
                except (ValueError, RecursionError):   # (not JSON, an integer of 5000 digits, nesting too deep)
                    args, ok = {}, False
                result = _call_tool(env, c["name"], args) if ok else "error: invalid tool call"
                # (a file name that is not UTF-8 comes back as lone surrogates, which no request can carry)
                result = result.encode("utf-8", "backslashreplace").decode("utf-8")
                valid_args += ok
                malformed += not ok
                bad |= not ok
                tool_s += time.perf_counter() - t_tool
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
            record["tool_s"] = tool_s
            record["harness_s"] = time.perf_counter() - t_step - reply.e2e_s - tool_s
            steps.append(record)
            if bad:
                reason = "invalid_tool_call"
                break
            if out_of_time:
                reason = "timeout"
                break
            continue
        record["tool_s"] = 0.0
        record["harness_s"] = time.perf_counter() - t_step - reply.e2e_s
        steps.append(record)
        if leaked:  # a call was attempted but could not be parsed: not a final answer
            reason = "invalid_tool_call"
            break
        answer = reply.content
        t_check = time.perf_counter()
        reason = "success" if env.check(answer) else "wrong_answer"
        check_s = time.perf_counter() - t_check
        break
    transcript = messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])
    total = lambda key: sum(s.get(key) or 0 for s in steps)  # noqa: E731
    return {"reason": reason, "success": reason == "success", "steps": len(steps),
            "total_s": time.perf_counter() - t_start, "model_s": total("model_s"), "tool_s": total("tool_s"),
            "harness_s": total("harness_s"), "check_s": check_s,
            "ttft_s": [s["ttft_s"] for s in steps if s.get("ttft_s") is not None],
            "completion_tokens": total("completion_tokens"), "nfe": total("nfe"),
            "valid_tool_args": valid_args, "tool_calls": total_args, "malformed": malformed,
            "step_records": steps, "transcript": transcript}


def _call_tool(env: Environment, name: str, args: dict) -> str:
    """A tool's result; a tool that fails on its input in a way it did not foresee (an overflow, a value it cannot
    take, the file system) answers with the error, as the tools report the errors they foresee. Any other
    exception (a bug of the harness's tools) ends the task run as harness_error (`_attempt`): not the model's."""
    try:
        return env.call(name, args)
    except (ArithmeticError, ValueError, OSError, RecursionError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


def _failure(reason: str, error: str, steps: list[dict] | None = None) -> dict:
    """A task run that ended before it measured anything (`reason` one of NOT_MEASURED)."""
    return {"reason": reason, "success": False, "error": error, "steps": 0, "total_s": 0.0,
            "model_s": 0.0, "tool_s": 0.0, "harness_s": 0.0, "check_s": 0.0, "ttft_s": [], "completion_tokens": 0,
            "nfe": 0, "valid_tool_args": 0, "tool_calls": 0, "malformed": 0, "step_records": steps or [],
            "transcript": []}


# what a resumed run must share with its first part (metadata.json), or its results would not be one run's
# (`runs` may grow: more runs of each task extend it)
SAME_ON_RESUME = ("endpoints", "suites", "tasks_per_suite", "conditions", "step_limit", "task_timeout_s",
                  "request_timeout_s", "max_tokens", "thinking", "split")


def _resume_settings(meta: dict) -> dict:
    """The SAME_ON_RESUME fields of a run's metadata; endpoints by name and model, not address (a server
    may come back on another port)."""
    out = {k: meta.get(k) for k in SAME_ON_RESUME}
    out["split"] = out["split"] or "test"   # (runs written before the option drew test seeds)
    out["endpoints"] = [(e["name"], e["model"]) for e in out["endpoints"] or []]
    return out


# what a run writes into its directory besides results.jsonl (other files there are left alone: notes.md, a
# hand-written reading, is read into the report)
RUN_FILES = ("metadata.json", "summary.json", "report.md", "tasks", "latency_layers.png", "dispersion.png",
             "success_vs_time.png")


def run_harness(cfg: HarnessConfig, out: str | Path, resume: bool = False) -> dict:
    out = Path(out)
    results_path = out / "results.jsonl"
    whole: list[tuple[str, dict]] = []   # the lines of results.jsonl resumed, with their records
    if resume and results_path.is_file():
        # a run killed while writing leaves at most one partial last line: drop it and redo that task run
        whole = json_lines(results_path)
        write_text_atomic(results_path, "".join(line + "\n" for line, _ in whole))
    elif results_path.exists():
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    elif out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory for the run; choose another --out")
    elif not resume:   # a new run writes these: files of those names and no run to resume are someone else's
        # (with --resume they are a run's killed before its first result: its metadata.json)
        held = [name for name in RUN_FILES if (out / name).exists()]
        if held:
            raise ValueError(f"{out} holds {', '.join(held)} but no results.jsonl of a run to resume: a new run would "
                             "overwrite them; choose another --out (or move them)")
    previous = [record for _, record in whole]
    tasks = [t for s in cfg.suites for t in suite_tasks(s, cfg.tasks_per_suite, cfg.split)]  # fails before any file is written
    for endpoint in cfg.endpoints:
        _check_reachable(cfg, endpoint)
    out.mkdir(parents=True, exist_ok=True)
    meta = _metadata(cfg)
    if previous and not (out / "metadata.json").is_file():   # its runs' settings unknown: they could not be checked
        raise ValueError(f"{out} holds results.jsonl but no metadata.json: the settings its task runs were made with "
                         "are unknown, so new runs could not be told to match them; choose another --out")
    if previous:  # a resumed run keeps its first metadata, notes each resume
        try:
            first = json.loads(read_text(out / "metadata.json"))
            was = _resume_settings(first)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:   # (not JSON, or not a run's metadata)
            raise ValueError(f"{out / 'metadata.json'} cannot be read ({type(exc).__name__}: {exc}); the run cannot "
                             "be resumed") from None
        now = _resume_settings(meta)
        changed = [k for k in SAME_ON_RESUME if was[k] != now[k]]
        if changed:  # its task runs would be mixed with runs under other settings
            raise ValueError(f"{out} holds a run with other {', '.join(changed)}; resume it with the same settings "
                             "or choose another --out")
        held = 1 + max(r["run"] for r in previous)
        if held > cfg.runs:
            raise ValueError(f"{out} holds {held} runs of each task; resume it with --runs {held} or more")
        first["runs"] = cfg.runs
        first.setdefault("resumed", []).append({k: meta[k] for k in ("date", "commit")})
        meta = first
    write_text_atomic(out / "metadata.json", json.dumps(meta, indent=2) + "\n")
    kept = [(line, r) for line, r in whole if r["reason"] not in NOT_MEASURED]
    if len(kept) < len(whole):   # to be done again: their new rows take their places (an atomic rewrite, as above)
        write_text_atomic(results_path, "".join(line + "\n" for line, _ in kept))
    done = {(r["task"], r["condition"], r["run"]) for _, r in kept}
    # cold: the first task run this harness sends to an endpoint (a resumed run's endpoints are warm)
    cold = {e.name: not any(r["endpoint"] == e.name for _, r in kept) for e in cfg.endpoints}
    infra_in_a_row = dict.fromkeys((e.name for e in cfg.endpoints), 0)
    with httpx.Client() as client:
        for run in range(cfg.runs):
            for endpoint in cfg.endpoints:
                for condition in cfg.conditions:
                    cname = cfg.condition_name(endpoint, condition)
                    for ht in tasks:
                        if (ht.id, cname, run) in done:
                            continue
                        try:
                            res = _attempt(client, cfg, endpoint, ht, condition)
                        except EndpointRefused as exc:   # (every task run would be refused alike)
                            raise ValueError(f"endpoint {endpoint.name} refused a chat request ({exc}); check "
                                             "--endpoint, --model and --api-key") from None
                        res.update(task=ht.id, suite=ht.suite, condition=cname, endpoint=endpoint.name,
                                   params=condition, run=run, cold=cold[endpoint.name])
                        cold[endpoint.name] = False
                        tdir = out / "tasks" / ht.id / cname.replace(": ", "_").replace("/", "_")
                        tdir.mkdir(parents=True, exist_ok=True)
                        (tdir / f"run{run}.json").write_text(json.dumps(
                            {"transcript": res.pop("transcript"), "steps": res.pop("step_records")}, indent=1))
                        with open(results_path, "a") as f:
                            f.write(json.dumps(res) + "\n")
                        if res["reason"] == "infrastructure_error":
                            infra_in_a_row[endpoint.name] += 1
                        else:
                            infra_in_a_row[endpoint.name] = 0
                        if infra_in_a_row[endpoint.name] == MAX_INFRA_IN_A_ROW:
                            raise ValueError(f"endpoint {endpoint.name}: {MAX_INFRA_IN_A_ROW} task runs in a row "
                                             f"failed to get a reply (the last: {res['error']}); is its server down? "
                                             f"Rerun with --resume when it is back ({out} keeps the runs so far)")
    results = [json.loads(x) for x in results_path.read_text().splitlines() if x.strip()]
    summary = summarise(results, cfg.runs)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_report(out, cfg, summary, results)
    return summary


def _check_reachable(cfg: HarnessConfig, endpoint: Endpoint) -> None:
    """Fail before the first task run when an endpoint cannot be reached (with the task runs' retries): every run
    would otherwise fail, minutes later. Any HTTP answer to /models will do; a list without the model asked for
    gets a warning."""
    for attempt in range(cfg.infra_retries + 1):
        try:
            _, models = list_models(endpoint.url, endpoint.api_key, timeout_s=min(cfg.request_timeout_s, 30.0))
            break
        except InfraError as exc:
            if attempt == cfg.infra_retries:
                raise ValueError(f"endpoint {endpoint.name}: {exc}") from None
            time.sleep(min(cfg.infra_backoff_s * 2 ** attempt, 10))
    # a warning, not a refusal: a server that ignores the name (llama.cpp's) answers anyway, and one that refuses
    # it ends the run at its first 404 (EndpointRefused)
    if models and endpoint.model not in models:
        print(f"warning: endpoint {endpoint.name} lists {', '.join(map(repr, models[:5]))}, not "
              f"{endpoint.model!r}: check --model", file=sys.stderr)


def _attempt(client: httpx.Client, cfg: HarnessConfig, endpoint: Endpoint, ht: HarnessTask, condition: dict) -> dict:
    """A task run, retried (with backoff) only when the infrastructure failed. Any other failure (a bug of the
    harness, an environment that could not be made or checked) ends this task run as harness_error, with the
    exception and its traceback in the transcript, not the whole evaluation."""
    for attempt in range(cfg.infra_retries + 1):
        try:
            res = run_task(client, cfg, endpoint, ht, condition)
            break
        except InfraError as exc:
            res = _failure("infrastructure_error", str(exc))
            if attempt < cfg.infra_retries:
                time.sleep(min(cfg.infra_backoff_s * 2 ** attempt, 10))
        except EndpointRefused:   # (the whole run's end: `run_harness`)
            raise
        except Exception as exc:   # (not retried: the harness would fail alike)
            error = f"{type(exc).__name__}: {exc}"
            res = _failure("harness_error", error, [{"error": error, "traceback": traceback.format_exc()}])
            break
    res["attempts"] = attempt + 1
    return res


def _metadata(cfg: HarnessConfig) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    import torch

    return {"commit": commit, "endpoints": [{"name": e.name, "url": e.url, "model": e.model} for e in cfg.endpoints],
            "suites": list(cfg.suites), "tasks_per_suite": cfg.tasks_per_suite, "runs": cfg.runs,
            "conditions": cfg.conditions, "step_limit": cfg.step_limit, "task_timeout_s": cfg.task_timeout_s,
            "request_timeout_s": cfg.request_timeout_s, "max_tokens": cfg.max_tokens, "thinking": cfg.thinking,
            "split": cfg.split, "infra_retries": cfg.infra_retries, "infra_backoff_s": cfg.infra_backoff_s,
            "python": platform.python_version(), "torch": torch.__version__,
            "httpx": httpx.__version__, "machine": platform.machine(), "processor": platform.processor(),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


# -- statistics and report ---------------------------------------------------------------------------------


def _dist(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p90": None, "min": None, "max": None}
    s = sorted(values)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))],
            "min": s[0], "max": s[-1]}


def _speed(rows: list[dict]) -> dict:
    tokens, nfe, model_s = (sum(r[k] for r in rows) for k in ("completion_tokens", "nfe", "model_s"))
    return {"completion_tokens": tokens, "tokens_per_s": tokens / model_s if model_s else None,
            "tpf": tokens / nfe if nfe else None}


def _by_task(rows: list[dict]) -> dict[str, list[bool]]:
    """Each task's outcomes over its runs."""
    out: dict[str, list[bool]] = {}
    for r in rows:
        out.setdefault(r["task"], []).append(r["success"])
    return out


def _success_stderr(rows: list[dict]) -> float | None:
    """The standard error of the success rate with the task as the unit: the runs of one task are not
    independent draws (at temperature 0 they repeat each other), so the spread is that of the tasks' own
    success rates, sd / sqrt(tasks) (a binomial over task runs understated it by about sqrt(runs)). None
    with fewer than 2 tasks."""
    rates = [sum(v) / len(v) for v in _by_task(rows).values()]
    return statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) >= 2 else None


def _quality(rows: list[dict]) -> dict:
    """Success (mean, and standard error over tasks: `_success_stderr`) and formatting stability of task
    runs: an attempted call is a parsed call or tool-call markup left in the text; it is malformed when the
    markup leaked or its arguments are invalid."""
    n = len(rows)
    p = sum(r["success"] for r in rows) / n if n else None
    calls = sum(r["tool_calls"] for r in rows)
    malformed = sum(r["malformed"] for r in rows)
    invalid = sum(r["tool_calls"] - r["valid_tool_args"] for r in rows)
    attempted = calls + malformed - invalid
    return {"success_mean": p, "success_stderr": _success_stderr(rows),
            "tool_calls": calls, "invalid_calls": invalid, "leaked_markup": malformed - invalid,
            "malformed": malformed, "malformed_rate": malformed / attempted if attempted else None}


def _solved_total_s(rows: list[dict]) -> float | None:
    """Median total seconds of the task runs that succeeded (None: none did). The median over every run rewards
    failing fast (a run that ends on a bad call at its first step is short); at equal success this one compares
    the time a solution takes."""
    return _dist([r["total_s"] for r in rows if r["success"]])["median"]


def _suite_summary(rows: list[dict]) -> dict:
    return {**_quality(rows), "task_runs": len(rows), "total_s": _dist([r["total_s"] for r in rows])["median"],
            "solved_total_s": _solved_total_s(rows), **_speed(rows)}


def summarise(results: list[dict], runs: int) -> dict:
    out = {}
    for cname in dict.fromkeys(r["condition"] for r in results):
        rows = [r for r in results if r["condition"] == cname]
        quality = [r for r in rows if r["reason"] not in NOT_MEASURED]
        by_task = _by_task(quality)
        calls = sum(r["tool_calls"] for r in quality)
        cold = [r for r in rows if r.get("cold")]
        out[cname] = {
            "endpoint": rows[0]["endpoint"], "params": rows[0]["params"],
            "task_runs": len(rows), "quality_runs": len(quality), **_quality(quality),
            f"pass@{runs}": (sum(any(v) for v in by_task.values()) / len(by_task)) if by_task else None,
            f"pass^{runs}": (sum(all(v) for v in by_task.values()) / len(by_task)) if by_task else None,
            "reasons": {k: sum(r["reason"] == k for r in rows) for k in REASONS},
            "valid_tool_arg_rate": (sum(r["valid_tool_args"] for r in quality) / calls) if calls else None,
            **{k: _dist([r[k] for r in quality]) for k in ("model_s", "tool_s", "harness_s", "total_s")},
            "solved_total_s": _solved_total_s(quality),
            "ttft_s": _dist([t for r in quality for t in r["ttft_s"]]),
            "ttft_by_turn": _ttft_by_turn(quality),
            **_speed(quality),
            "cold": [{"task": r["task"], "total_s": r["total_s"], "warm_total_s": _dist(
                [w["total_s"] for w in quality if w["task"] == r["task"] and not w.get("cold")])["median"]}
                for r in cold],
            "by_suite": {s: _suite_summary([r for r in quality if r["suite"] == s])
                         for s in dict.fromkeys(r["suite"] for r in quality)},
        }
    return out


def _ttft_by_turn(runs: list[dict]) -> dict[int, float]:
    """Median TTFT of the n-th model call of a task run (the history grows with n), per n."""
    by: dict[int, list[float]] = {}
    for r in runs:
        for n, t in enumerate(r["ttft_s"], start=1):  # the TTFTs of a run's model calls, in order
            by.setdefault(n, []).append(t)
    return {n: _dist(v)["median"] for n, v in sorted(by.items())}


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _block_order(params: dict) -> int:
    """Where a condition goes among block sizes: ar first, then by block size (0: the server's default, or a
    size that is not a number, from a run older than conditions were checked)."""
    size = params.get("block_size")
    return -1 if params.get("algorithm") == "ar" else size if is_int(size) else 0


def _block_label(params: dict) -> str:
    if params.get("algorithm") == "ar":
        return "ar (one token per step)"
    size = str(params.get("block_size", "server default"))
    return f"{size} (verify: ar's output)" if params.get("algorithm") == "verify" else size


def write_report(out: Path, cfg: HarnessConfig, summary: dict, results: list[dict]) -> None:
    k, f = cfg.runs, _fmt
    eps = ", ".join(f"`{e.name}` ({e.url}, model `{e.model}`)" for e in cfg.endpoints)
    suites = ", ".join(f"{s} ({len({r['task'] for r in results if r['suite'] == s})} tasks)" for s in cfg.suites)
    seeds = "test seeds" if cfg.split == "test" else f"{cfg.split} seeds (`--split {cfg.split}`: not for reporting)"
    lines = ["# Agent evaluation report", "", f"Endpoints: {eps}. Suites: {suites}, {seeds}; "
             f"{cfg.runs} run(s) per task and condition, step limit "
             f"{cfg.step_limit}, max_tokens {cfg.max_tokens}, thinking {'on' if cfg.thinking else 'off'}, temperature 0. "
             "Conditions and machine: `metadata.json`; every step of every task run: `tasks/`.", "",
             "| condition | task runs (+ not measured) | success (± s.e. over tasks) | pass@k | pass^k | valid tool args | model s (median / p90) "
             "| tool s (median) | total s (median / p90, min-max) | TTFT s (median) | tokens/s | TPF |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cname, s in summary.items():
        t = s["total_s"]
        left = s["task_runs"] - s["quality_runs"]   # (infrastructure and harness errors: in no figure of the row)
        lines.append(f"| {cname} | {s['quality_runs']}{f' (+{left})' if left else ''} | "
                     f"{f(s['success_mean'])} ± {f(s['success_stderr'])} | "
                     f"{f(s[f'pass@{k}'])} | {f(s[f'pass^{k}'])} | {f(s['valid_tool_arg_rate'])} | "
                     f"{f(s['model_s']['median'])} / {f(s['model_s']['p90'])} | {f(s['tool_s']['median'])} | "
                     f"{f(t['median'])} / {f(t['p90'])} ({f(t['min'])}-{f(t['max'])}) | {f(s['ttft_s']['median'])} | "
                     f"{f(s['tokens_per_s'], 1)} | {f(s['tpf'], 2)} |")
    lines += ["", f"k = {k} runs. Per suite (success is pass@1 for humaneval; tokens/s = completion tokens over model "
              "time; TPF = completion tokens per forward pass, from `usage.nfe`):", "",
              "| condition | suite | task runs | success | median total s | median total s, solved runs | tokens/s | TPF |",
              "|---|---|---|---|---|---|---|---|"]
    for cname, s in summary.items():
        for suite, b in s["by_suite"].items():
            lines.append(f"| {cname} | {suite} | {b['task_runs']} | {f(b['success_mean'])} | {f(b['total_s'])} | "
                         f"{f(b.get('solved_total_s'))} | {f(b['tokens_per_s'], 1)} | {f(b['tpf'], 2)} |")
    lines += ["", "How task runs ended:", "", "| condition | " + " | ".join(REASONS) + " |",
              "|---|" + "---|" * len(REASONS)]
    for cname, s in summary.items():
        lines.append(f"| {cname} | " + " | ".join(str(s["reasons"][r]) for r in REASONS) + " |")
    lines += ["", "Formatting stability per block size. An attempted call is a parsed tool call or tool-call markup "
              "the server could not parse (left in the text); it is malformed when the markup leaked or the "
              "arguments are not a JSON object or name no tool of the task:", "",
              "| condition | block size | parsed calls | invalid arguments | leaked markup | malformed per attempted call |",
              "|---|---|---|---|---|---|"]
    order = [e.name for e in cfg.endpoints]
    for cname, s in sorted(summary.items(), key=lambda kv: (order.index(kv[1]["endpoint"]),
                                                            _block_order(kv[1]["params"]))):
        lines.append(f"| {cname} | {_block_label(s['params'])} | {s['tool_calls']} | {s['invalid_calls']} | "
                     f"{s['leaked_markup']} | {f(s['malformed_rate'])} |")
    turns = sorted({int(n) for s in summary.values() for n in s["ttft_by_turn"]})
    shown = [n for n in turns if n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48) or n == turns[-1]]
    if shown:
        lines += ["", "Time to first token by turn (median seconds over task runs; the n-th model call of a task run "
                  "resends a history that grows with n: flat means the server reuses it):", "",
                  "| condition | " + " | ".join(f"turn {n}" for n in shown) + " |", "|---|" + "---|" * len(shown)]
        for cname, s in summary.items():
            by = {int(n): v for n, v in s["ttft_by_turn"].items()}
            lines.append(f"| {cname} | " + " | ".join(f(by.get(n)) for n in shown) + " |")
    lines += ["", "Cold start: the first task run this harness sent to each endpoint, against the warm runs of the same "
              "task and condition (total seconds):", ""]
    lines += [f"- {c}, {x['task']}: cold {x['total_s']:.2f} s, warm median {f(x['warm_total_s'], 2)} s"
              for c, s in summary.items() for x in s["cold"]]
    lines.append("")
    if _plots(out, summary, results):
        lines += ["![latency layers](latency_layers.png)", "", "![success against time](success_vs_time.png)", "",
                  "![dispersion per task](dispersion.png)", ""]
    if (out / "notes.md").is_file():  # a hand-written reading, kept when the report is written again
        lines += ["## Reading", "", (out / "notes.md").read_text().strip(), ""]
    write_text_atomic(out / "report.md", "\n".join(lines))


def _plots(out: Path, summary: dict, results: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary)
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(names)), 4))
    bottom = [0.0] * len(names)
    for layer in ("model_s", "tool_s", "harness_s"):
        vals = [summary[c][layer]["median"] or 0 for c in names]
        ax.bar(range(len(names)), vals, bottom=bottom, label=layer.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
    ax.set(ylabel="median seconds per task run", title="latency layers per condition")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_layers.png", dpi=110)
    plt.close(fig)
    _success_vs_time(plt, out, summary)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    fig, ax = plt.subplots(figsize=(max(6, len(tasks) * 0.4), 4))
    for j, c in enumerate(names):
        for i, t in enumerate(tasks):
            ys = [r["total_s"] for r in results if r["task"] == t and r["condition"] == c]
            ax.scatter([i + 0.15 * j] * len(ys), ys, s=12, color=f"C{j}", label=c if i == 0 else None)
    ax.set_xticks(range(len(tasks)), tasks, rotation=80, fontsize=6)
    ax.set(ylabel="total seconds", title="dispersion over runs, per task")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "dispersion.png", dpi=110)
    plt.close(fig)
    return True


def _success_vs_time(plt: object, out: Path, summary: dict) -> None:
    """Success against median time; conditions that differ only in block size are joined by a line,
    in block-size order, each point labelled with its block size."""
    series: dict[str, list[tuple[int, float, float]]] = {}
    for s in summary.values():
        rest = {k: v for k, v in s["params"].items() if k != "block_size"}
        key = s["endpoint"] + " " + (",".join(f"{k}={v}" for k, v in sorted(rest.items())) or "default")
        series.setdefault(key, []).append((_block_order(s["params"]), s["total_s"]["median"] or 0,
                                           s["success_mean"] or 0))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (key, pts) in enumerate(series.items()):
        pts.sort()
        ax.plot([p[1] for p in pts], [p[2] for p in pts], "o-", color=f"C{i}", label=key)
        for j, (size, x, y) in enumerate(pts):
            if size > 0:  # staggered, so that labels of nearby points stay readable
                ax.annotate(f"b={size}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3 + 9 * j),
                            color=f"C{i}")
    ax.set(xlabel="median total seconds per task run", ylabel="success rate", title="success against time across "
           "block sizes", ylim=(-0.05, 1.05))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "success_vs_time.png", dpi=110)
    plt.close(fig)
