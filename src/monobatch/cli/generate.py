"""`monobatch generate`: raw completion in-process (llama-completion's role).

The prompt is sent as is (BOS per the model's add_bos_token); ``--chat`` wraps it as one user
message through the chat template. Text streams to stdout as produced; diagnostics go to stderr.
Holds no decode logic: it builds one Request and drives the BatchScheduler.
"""

from __future__ import annotations

import argparse
import json
import sys

from monobatch.chat_output import REASONING_FORMATS, ChatDelta, ChatReply
from monobatch.cli.args import (add_constraint_args, add_model_args, add_sampling_args, constraint_flag,
                                engine_settings, open_engine, opening_messages, read_prompt, sampling_flags)
from monobatch.chat_prompt import prepare_chat
from monobatch.engine.params import resolve_sampling
from monobatch.errors import InvalidRequestError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch generate`` and its flags."""
    p = sub.add_parser("generate", help="raw completion on the engine, streamed to stdout",
                       description="Complete a prompt with the model and stream the text to stdout "
                                   "(diagnostics on stderr). The prompt is sent as is; --chat sends it as "
                                   "a user message through the model's chat template.")
    p.add_argument("positional_prompt", nargs="?", metavar="PROMPT", help="the prompt (the same as -p)")
    p.add_argument("-p", "--prompt", help="the prompt (default: read stdin)")
    p.add_argument("-f", "--file", help="read the prompt from this file (llama.cpp's -f; one trailing newline dropped)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", help="with --chat: a system message before the prompt")
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS,
                   help="with --chat: separate = a <think> block's text goes to stderr (json: reasoning_content), "
                        "none = all text is the reply (default separate)")
    p.add_argument("--output-format", choices=("text", "json"), default="text",
                   help="text: stream the completion; json: one object with text, token_ids, finish_reason, usage, timings (ms)")
    add_model_args(p)
    add_sampling_args(p)
    add_constraint_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Generate one completion; returns the exit code. The flags that need no model are checked
    before torch is imported (seconds on a small machine): a bad value is refused at once."""
    if ns.system is not None and not ns.chat:
        raise InvalidRequestError("--system needs --chat (a raw prompt has no system message)", "system")
    if (ns.chat_template is not None or ns.chat_template_file is not None) and not ns.chat:
        flag = "--chat-template" if ns.chat_template is not None else "--chat-template-file"
        raise InvalidRequestError(f"{flag} needs --chat (a raw prompt is not templated)", flag.removeprefix("--"))
    if ns.reasoning_format is not None and not ns.chat:
        raise InvalidRequestError("--reasoning-format needs --chat (a raw completion is not split into reasoning "
                                  "and reply)", "reasoning_format")
    prompt = read_prompt(ns.positional_prompt, ns.prompt, 'pass it as an argument, with -p or -f, or pipe it on stdin',
                         ns.file)
    flags = sampling_flags(ns)
    if flags.get("logprobs") is not None and ns.output_format != "json":
        raise InvalidRequestError("--logprobs needs --output-format json", "logprobs")
    structured = constraint_flag(ns)
    if structured is not None:
        flags["structured"] = structured
    resolve_sampling(None, flags, entry_point="generate")  # refuse bad values before loading anything
    engine_settings(ns)  # and the engine flags (open_engine checks them again)
    from monobatch.engine.sequence import Request  # torch: imported only when generating

    scheduler = open_engine(ns)
    loaded = scheduler.engine.loaded
    params = resolve_sampling(None, flags, loaded.generation_defaults, entry_point="generate")
    if structured is not None:
        scheduler.engine.grammars.compile(structured)  # a bad schema/grammar/regex: one line, exit 1
    tok = loaded.tokenizer
    splitter = None
    if ns.chat:
        messages = opening_messages(ns) + [{"role": "user", "content": prompt}]
        chat = prepare_chat(tok, messages)  # the chat endpoint's prompt: message text is data, never a control token
        prompt_ids = chat.prompt_ids
        splitter = ChatReply(ns.reasoning_format or "separate", chat.in_reasoning)
    else:
        prompt_ids = tok.encode(prompt)
    request = Request("generate-0", prompt_ids, params)
    scheduler.add_request(request)
    stream = ns.output_format == "text"
    token_ids: list[int] = []
    text: list[str] = []
    logprobs: list = []
    last = None
    for out in scheduler.run():
        token_ids += out.token_ids
        text.append(out.text)
        logprobs += out.logprobs or []
        if stream and out.text:
            _show(splitter.feed(out.text) if splitter else ChatDelta(content=out.text))
        last = out
    if stream and splitter:
        _show(splitter.flush(last.finish_reason.value))
    m = last.metrics
    timings = {"load_ms": round(loaded.load_seconds * 1000, 1), "ttft_ms": round(m.ttft_ms, 2),
               "total_ms": round((m.finished_time - m.arrival_time) * 1000, 2),
               "prefill_tok_per_s": round(m.prefill_tok_per_s, 1), "decode_tok_per_s": round(m.decode_tok_per_s, 1)}
    if stream:
        sys.stdout.write("\n")
        decode = f"{timings['decode_tok_per_s']:.1f}" if len(token_ids) > 1 else "-"  # a rate needs two tokens
        print(f"[{len(prompt_ids)} prompt + {len(token_ids)} generated tokens, finish_reason={last.finish_reason.value}, "
              f"TTFT {timings['ttft_ms']:.0f} ms, decode {decode} tok/s]", file=sys.stderr)
    else:
        result = {
            "text": "".join(text),
            "token_ids": token_ids,
            "finish_reason": last.finish_reason.value,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
                      "total_tokens": len(prompt_ids) + len(token_ids)},
            "timings": timings,
            "model": loaded.name,
        }
        if splitter is not None:  # the reply split as the server's chat endpoint splits it
            parts = splitter.feed(result["text"])
            parts += splitter.flush(last.finish_reason.value)
            result["content"] = parts.content
            if splitter.has_reasoning:
                result["reasoning_content"] = parts.reasoning
        if params.logprobs is not None:
            result["logprobs"] = [{"token_id": t, "token": tok.token_text(t), "logprob": lp,
                                   "top_logprobs": [{"token_id": a, "token": tok.token_text(a), "logprob": b} for a, b in top]}
                                  for t, lp, top in logprobs]
        print(json.dumps(result, ensure_ascii=False))
    return 0


def _show(parts: ChatDelta) -> None:
    """Stream a reply piece: reasoning to stderr (it is not the answer), content to stdout."""
    if parts.reasoning:
        sys.stderr.write(parts.reasoning)
        sys.stderr.flush()
    if parts.content:
        sys.stdout.write(parts.content)
        sys.stdout.flush()
