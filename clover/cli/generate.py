"""`clover generate` and `clover chat`: decoding from the terminal; `clover serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TextIO

import torch

from clover.cli.options import api_key, nonnegative_int, output_file, port, positive_int
from clover.engine.engine import Engine, GenerationResult
from clover.engine.sampling import ALGORITHMS, InvalidParameter, SamplingParams, check_generation_defaults
from clover.engine.structured import auto_tool_calls
from clover.engine.trace import render_steps_ansi, write_trace_html
from clover.model.chat import StreamingParser, lone_surrogate, parse_output, validate_tools
from clover.model.checkpoint import Loaded, load_for_generation
from clover.model.config import GenerationConfig
from clover.model.files import read_text
from clover.model.tokenizer import Tokenizer

DIM, RESET = "\033[2m", "\033[0m"


def _dimmed(stream: TextIO) -> tuple[str, str]:
    """The escape codes that dim a status line on `stream`, or none where it is not a terminal (a pipe, a file)."""
    return (DIM, RESET) if stream.isatty() else ("", "")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the shipped clover-tiny, or "
                                                  "$CLOVER_MODEL)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (default float32; auto: as stored)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding passes with torch.compile (model.compile_decode): on 2 CPU cores ar decodes "
                        "1.8-2.5x faster, the block decoders 1.0-1.6x; the first use of each pass compiles it "
                        "(up to minutes, cached on disk for later runs)")


def _load(args: argparse.Namespace) -> Loaded:
    # a failed request's error is the command's to print, once, as one line: the engine module logs it for
    # servers (here through Python's last-resort handler, an unexpected one with its traceback). Only that module:
    # the structured-output warnings ("clover.engine", e.g. tool calls not held to their schemas) still show.
    logging.getLogger("clover.engine.engine").addHandler(logging.NullHandler())
    loaded = load_for_generation(args.model, args.dtype, args.device)
    check_generation_defaults(loaded.generation, loaded.model.config.vocab_size,
                              str(loaded.directory / "generation_config.json"))
    if args.compile:   # the passes compile on first use (the engine's warm_up would build every policy's)
        dim, reset = _dimmed(sys.stderr)
        print(f"{dim}compiling the decoding passes as they are first used (cached on disk for later runs)...{reset}",
              file=sys.stderr)
        loaded.model.compile_decode()
    return loaded


def _add_decoding_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding (defaults from the checkpoint's generation_config.json)")
    g.add_argument("--algorithm", choices=ALGORITHMS, help="low_confidence (block diffusion), ar, or verify (block "
                                                           "drafts checked by the causal head: ar's output)")
    g.add_argument("--block-size", type=int, help="block size (default: the model's)")
    g.add_argument("--threshold", type=float, help="confidence to accept a position")
    g.add_argument("--max-accept", type=int, help="cap on positions accepted per step")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, help="0 is greedy")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the likeliest "
                                                           "(0: off)")
    g.add_argument("--seed", type=int)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    g.add_argument("--show-steps", action="store_true", help="colour each token by the denoising step that "
                                                              "accepted it")
    g.add_argument("--trace", metavar="FILE.html", type=output_file, help="write a page that replays the denoising step by step "
                                                                      "(chat: of the latest reply, replaced at each)")


def sampling_params(args: argparse.Namespace, generation: GenerationConfig) -> SamplingParams:
    """The checkpoint's decoding defaults with the options given on the command line."""
    decoding = generation.merged(
        algorithm=args.algorithm, block_size=args.block_size, threshold=args.threshold, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    return SamplingParams(
        **decoding, max_new_tokens=args.max_new_tokens, seed=args.seed, min_p=args.min_p, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos, max_accept_per_step=args.max_accept,
        record_steps=bool(args.show_steps or args.trace),
    )


FLAGS = {"max_accept_per_step": "--max-accept", "stop_token_ids": "--stop-token-id"}   # (the others: --field-name)


def check_decoding_flags(args: argparse.Namespace) -> None:
    """A decoding option out of its bounds (`SamplingParams.validate`'s, the one place they are written) as a
    usage error naming the flag, exit 2, before the model loads (it was exit 1 naming the field, after the
    load); stop token ids are checked against the vocabulary once it is known."""
    try:
        sampling_params(args, GenerationConfig.from_dict({})).validate(vocab_size=2**62)
    except InvalidParameter as exc:
        flag = FLAGS.get(exc.param, "--" + exc.param.replace("_", "-"))
        print(f"clover {args.command}: error: argument {flag}: {str(exc).removeprefix(exc.param + ' ')}",
              file=sys.stderr)
        raise SystemExit(2) from None


def _read_tools(path: str) -> list[dict]:
    try:
        tools = json.loads(read_text(path))
    except OSError as exc:
        raise ValueError(f"cannot read --tools {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--tools {path} is not valid JSON ({exc.msg}, line {exc.lineno})") from exc
    if not isinstance(tools, list):
        raise ValueError(f"--tools {path} must hold a JSON list of OpenAI tool definitions")
    return validate_tools(tools)


def _utf8(text: str, what: str) -> str:
    """`text` from the command line or standard input, where bytes that are not UTF-8 arrive as lone surrogates
    (Python's surrogateescape): refused here, naming where they came from."""
    if lone_surrogate(text):
        raise ValueError(f"{what} is not UTF-8 text")
    return text


def _read_prompt(args: argparse.Namespace) -> str:
    if args.file:
        if args.prompt is not None:
            raise ValueError("give the prompt as an argument or with --file, not both")
        return read_text(args.file)
    if args.prompt is not None and args.prompt != "-":
        return _utf8(args.prompt, "the prompt")
    if sys.stdin.isatty() and args.prompt is None:
        raise ValueError("no prompt: give it as an argument, with --file, or on standard input")
    if not hasattr(sys.stdin, "buffer"):   # (a text stream put in its place)
        return sys.stdin.read()
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:   # (read as text, it became "a lone UTF-16 surrogate" further on)
        raise ValueError(f"standard input is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _show(result: GenerationResult, prompt: str, tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    if args.show_steps:
        print(render_steps_ansi(result, tokenizer.decode), file=sys.stderr if args.json else sys.stdout)
    if args.trace:
        write_trace_html(args.trace, result, prompt, tokenizer.decode)
        dim, reset = _dimmed(sys.stderr)
        print(f"{dim}trace written to {args.trace}{reset}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    check_decoding_flags(args)
    # options that shape a chat turn mean nothing to a plain continuation: refuse them rather than drop them
    for flag, given, what in (("--tools", args.tools, "tools are offered in a chat turn"),
                              ("--system", args.system, "the system message opens the chat"),
                              ("--no-think", args.no_think, "thinking is a chat turn's"),
                              ("--free-tool-calls", args.free_tool_calls, "it applies to the tools of a chat turn")):
        if given is not None and given is not False and not args.chat:
            raise ValueError(f"{flag} needs --chat: {what}")
    if args.free_tool_calls and not args.tools:
        raise ValueError("--free-tool-calls needs --tools: without tools no call is held to them")
    if args.tools and args.ignore_eos and not args.free_tool_calls:   # (it turned the grammar off without a word)
        raise ValueError("--ignore-eos with --tools: the calls' grammar ends the reply when a call is complete; "
                         "add --free-tool-calls to decode past it with the model's own calls")
    text = _read_prompt(args)
    if not text.strip():
        raise ValueError("the prompt is empty")
    loaded = _load(args)
    params = sampling_params(args, loaded.generation)
    tok = loaded.tokenizer
    prompt = text
    tools = _read_tools(args.tools) if args.tools else None
    ids = tok.encode(prompt)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}]
        prompt = tok.apply_chat_template(messages, tools=tools, enable_thinking=not args.no_think)
        ids = tok.encode_chat(messages, tools=tools, enable_thinking=not args.no_think)
        if tools and not args.free_tool_calls and params.constraint is None and not params.ignore_eos:
            params = params.with_(constraint=auto_tool_calls(tools, tok, thinking=not args.no_think))
    engine = Engine(loaded.model, tok)
    streaming = not (args.json or args.show_steps)
    result, error = None, None
    with torch.inference_mode():
        for event in engine.stream(ids, params):
            if streaming and event.text:
                print(event.text, end="", flush=True)
            result, error = event.result or result, event.error or error
    if streaming:
        print()
    if args.json:
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               **({"error": error} if error else {}),
               "prompt_tokens": len(result.prompt_ids), "stats": result.stats.to_dict(),
               "sampling": {k: v for k, v in params.__dict__.items() if k not in ("record_steps", "constraint")}}
        if args.chat:
            parsed = parse_output(result.text, thinking=not args.no_think, tools=tools)
            out.update(reasoning=parsed.reasoning, content=parsed.content)
            if tools:
                out["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
                out["tool_call_errors"] = parsed.errors
                out["tool_grammar"] = params.constraint is not None
        if params.record_steps:
            out["accept_steps"] = result.accept_steps
        print(json.dumps(out))
    elif not args.show_steps:
        s = result.stats
        dim, reset = _dimmed(sys.stderr)
        print(f"{dim}[{s.generated_tokens} tokens, {s.nfe} forwards, TPF {s.tpf:.2f}, {s.tokens_per_s:.1f} tokens/s, "
              f"finish: {result.finish_reason}]{reset}", file=sys.stderr)
    _show(result, prompt, tok, args)
    if error:
        print(f"error: {error}", file=sys.stderr)
    return 1 if result.finish_reason == "error" else 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="decode a prompt with block diffusion or AR",
        description="Decode a prompt (argument, --file, or standard input) and print the text as each block "
                    "becomes final.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  clover generate 'def fibonacci(n):' --max-new-tokens 64\n"
               "  clover generate --chat 'What is 2+3?' --no-think --show-steps\n"
               "  echo 'import os' | clover generate --algorithm ar --json\n"
               "  clover generate 'class Stack:' --threshold 0.7 --block-size 16 --trace steps.html",
    )
    p.add_argument("prompt", nargs="?", help="prompt text ('-' or absent: standard input)")
    p.add_argument("--file", help="read the prompt from this file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--no-think", action="store_true", help="thinking off (with --chat)")
    p.add_argument("--tools", metavar="FILE.json", help="OpenAI tool definitions offered in the chat turn (with --chat); "
                                                        "--json then lists the parsed tool calls")
    p.add_argument("--free-tool-calls", action="store_true",
                   help="do not hold the calls the reply opens to the offered tools and their schemas (with --tools)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    _add_model_options(p)
    _add_decoding_options(p)
    p.set_defaults(func=cmd_generate)


# -- chat ---------------------------------------------------------------------------------------------


def _print_turn(engine: Engine, tok: Tokenizer, ids: list[int], params: SamplingParams, thinking: bool
                ) -> tuple[GenerationResult, str, str | None]:
    """Stream one reply; its result, its content and its error (None when it did not fail)."""
    parser = StreamingParser(thinking=thinking)
    dim, reset = _dimmed(sys.stdout)
    in_reasoning = False
    result, error = None, None
    for event in engine.stream(ids, params):
        result, error = event.result or result, event.error or error
        d = parser.feed(event.text)
        if event.finished:
            tail = parser.finish()
            d.reasoning += tail.reasoning
            d.content += tail.content
            d.tool_calls += tail.tool_calls
        if d.reasoning:
            if not in_reasoning:
                print(f"{dim}[thinking] ", end="")
                in_reasoning = True
            print(f"{dim}{d.reasoning}{reset}", end="", flush=True)
        if d.content or d.tool_calls:
            if in_reasoning:
                print(f"{reset}\n")
                in_reasoning = False
            print(d.content, end="", flush=True)
            for call in d.tool_calls:
                print(f"\n{dim}[tool call] {call.name}({call.arguments_json()}){reset}", end="")
    print(reset if in_reasoning else "")
    return result, parse_output(result.text, thinking=thinking).content, error


def cmd_chat(args: argparse.Namespace) -> int:
    check_decoding_flags(args)
    if args.system:
        _utf8(args.system, "--system")   # (else every turn would fail, and no /reset could help)
    loaded = _load(args)
    def new_engine(old: Engine | None = None) -> Engine:
        """(each turn resends the conversation: the prefix cache restores what it has seen; an engine made anew
        after an interrupted turn keeps the old one's cache)"""
        made = Engine(loaded.model, loaded.tokenizer, prefix_cache_bytes=args.prefix_cache_bytes)
        if old is not None and old.prefix is not None:
            made.prefix = old.prefix
        return made

    tok, engine = loaded.tokenizer, new_engine()
    params = sampling_params(args, loaded.generation)
    params.validate(loaded.model.config.vocab_size)   # a bad option is an error now, not at every turn
    context = loaded.model.config.max_position_embeddings
    if params.max_new_tokens >= context:   # (every turn would fail, and no /reset could help)
        raise ValueError(f"--max-new-tokens {params.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens")
    thinking, show_steps = not args.no_think, args.show_steps
    dim, reset = _dimmed(sys.stdout)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = []
    print(f"{dim}clover chat: {loaded.model.config.num_parameters()[0] / 1e6:.1f}M parameters, "
          f"{params.algorithm}, block {GenerationConfig.resolve_block_size(params.block_size, loaded.model.config)}, threshold "
          f"{params.threshold}. Commands: /think on|off, /steps on|off, /reset, /exit{reset}")
    failed = 0   # turns that ended in an error: a piped chat reports them in its exit status
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 1 if failed else 0
        line = line.strip()
        if not line:
            continue
        try:
            _utf8(line, "the line")
        except ValueError as exc:
            failed += 1
            print(f"error: {exc}", file=sys.stderr)
            continue
        if line.split()[0] in ("/exit", "/quit", "/reset") and len(line.split()) > 1:
            print(f"{dim}{line.split()[0]} takes nothing after it{reset}")
            continue
        if line in ("/exit", "/quit"):
            return 1 if failed else 0
        if line == "/reset":
            messages = []
            print(f"{dim}(history cleared){reset}")
            continue
        if line.split()[0] in ("/think", "/steps"):
            command, *rest = line.split()
            if rest not in (["on"], ["off"]):
                print(f"{dim}{command} takes on or off{reset}")
                continue
            if command == "/think":
                thinking = rest == ["on"]
                print(f"{dim}(thinking {'on' if thinking else 'off'}){reset}")
            else:
                show_steps = rest == ["on"]
                params = params.with_(record_steps=show_steps or bool(args.trace))
                print(f"{dim}(steps {'on' if show_steps else 'off'}){reset}")
            continue
        if line.startswith("/"):
            print(f"{dim}unknown command {line.split()[0]}; try /think, /steps, /reset, /exit{reset}")
            continue
        messages.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(system + messages, enable_thinking=thinking)
        try:
            ids = tok.encode_chat(system + messages, enable_thinking=thinking)
            result, content, error = _print_turn(engine, tok, ids, params.with_(cache_points=tok.reply_start(ids)),
                                                 thinking)
        except ValueError as exc:  # e.g. the conversation outgrew the context
            messages.pop()
            failed += 1
            print(f"error: {exc}." + (" Use /reset to start over." if messages else ""), file=sys.stderr)
            continue
        except KeyboardInterrupt:
            engine = new_engine(engine)  # drop the interrupted request
            messages.pop()
            print(f"\n{dim}(interrupted){reset}")
            continue
        if result.finish_reason == "error":   # the reply failed: it is not part of the history
            messages.pop()
            failed += 1
            print(f"error: {error}; the turn is left out of the history", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": content})
        s = result.stats
        cached = f", {s.cached_tokens} of {s.prompt_tokens} prompt tokens from the cache" if s.cached_tokens else ""
        print(f"{dim}[{s.generated_tokens} tokens, {s.nfe} forwards, TPF {s.tpf:.2f}, {s.tokens_per_s:.1f} "
              f"tokens/s{cached}]{reset}")
        if show_steps:
            print(render_steps_ansi(result, tok.decode))
        if args.trace:
            write_trace_html(args.trace, result, prompt, tok.decode)
            print(f"{dim}trace of this reply written to {args.trace}{reset}")


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="interactive multi-turn chat in the terminal",
        description="Chat with a model in the terminal; replies appear block by block.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  clover chat\n  clover chat --no-think --show-steps\n"
               "  clover chat --model runs/my-model --algorithm ar --system 'Answer briefly.'",
    )
    p.add_argument("--system", help="system message")
    p.add_argument("--no-think", action="store_true", help="start with thinking off (/think on turns it back on)")
    p.add_argument("--prefix-cache-bytes", type=nonnegative_int, default=256 << 20,
                   help="memory for the conversation's prefixes kept across turns, so a turn prefills only what is "
                        "new (default 256 MiB; 0 turns it off)")
    _add_model_options(p)
    _add_decoding_options(p)
    p.set_defaults(func=cmd_chat)


# -- serve --------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from clover.serving.app import serve

    env = os.environ.get("CLOVER_API_KEY")
    if args.api_key is None and env is not None and not env.strip():   # (exported, but empty: not "no key wanted")
        raise ValueError("CLOVER_API_KEY is set but empty: give it a key, or unset it to serve without one")
    api_key = args.api_key or env or None
    serve(args.model, args.host, args.port, api_key, args.max_batch_size, args.max_queue, args.dtype,
          args.device, args.served_model_name, args.prefix_cache_bytes, args.max_prefill_tokens or None,
          compile=args.compile, prefix_state_every=args.prefix_cache_state_every)
    return 0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve a model over the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, "
                    "/health, /metrics, /tokenize, /detokenize, /reset_prefix_cache. Extra body fields: algorithm, block_size, threshold, "
                    "max_accept_per_step, top_k, repetition_penalty, ignore_eos, min_tokens, constrain_tool_calls, cache_salt, "
                    "chat_template_kwargs.enable_thinking.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  clover serve --port 8000\n"
               "  clover serve --model runs/my-model --host 0.0.0.0 --api-key $KEY --max-batch-size 16",
    )
    _add_model_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--api-key", type=api_key, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: $CLOVER_API_KEY, so "
                                     "that the key need not appear in the process list)")
    p.add_argument("--max-batch-size", type=positive_int, default=32, help="sequences decoded together")
    p.add_argument("--max-queue", type=nonnegative_int, default=64,
                   help="waiting requests before answering 429 (0: none wait; 429 whenever the batch is full)")
    p.add_argument("--served-model-name", help="the model id clients use (default: the directory name)")
    p.add_argument("--prefix-cache-bytes", type=nonnegative_int, default=256 << 20,
                   help="memory for prefixes kept across requests (default 256 MiB; 0 turns it off)")
    p.add_argument("--prefix-cache-state-every", type=positive_int, default=16, metavar="BLOCKS",
                   help="keep the Gated DeltaNet states of cached prefixes after every BLOCKS-th block, besides "
                        "prompts' ends, branch points and each request's deepest block (default 16; 1: every block, "
                        "each state costing many blocks' K/V: clover.engine.prefix_cache)")
    p.add_argument("--max-prefill-tokens", type=nonnegative_int, default=512,
                   help="prompt tokens prefilled per engine step; longer prompts are prefilled in chunks between "
                        "the other requests' steps (default 512; 0: no limit)")
    p.set_defaults(func=cmd_serve)
