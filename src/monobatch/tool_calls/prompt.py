"""Tool requests' prompt side: tools and tool-call history put in the shape each format's templates expect."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import Counter
from typing import Any

from monobatch.errors import InvalidRequestError, json_kind
from monobatch.tokenizer.chat_template import normalize_messages
from monobatch.tool_calls.parser import JSON_ERRORS
from monobatch.tool_calls.request import ToolFormat, ToolSpec


def generic_system_prompt(spec: ToolSpec) -> str:
    """The system text GENERIC adds when tools are offered (see the module docstring)."""
    tools = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in spec.tools)
    many = "one or more calls" if spec.max_calls > 1 else "exactly one call"  # as the grammar allows
    name = "<tool name>" if spec.choice in ("auto", "required") else spec.choice
    calls = f'{{"tool_calls": [{{"name": "{name}", "arguments": {{<arguments>}}}}]}} ({many})'
    text = f"You can call these tools (name, description and a JSON schema of the arguments):\n{tools}\n\n"
    if spec.choice == "auto":
        return text + ("Reply with one JSON object and nothing else, either to call tools:\n"
                       f"{calls}\nor to answer the user in text:\n" + '{"response": "<your reply>"}')
    must = "a tool" if spec.choice == "required" else f'the tool "{spec.choice}"'
    return text + f"You must call {must}. Reply with one JSON object and nothing else:\n{calls}"


def prepare_messages(messages: Any, spec: ToolSpec | None, fmt: ToolFormat) -> tuple[list[dict], dict]:
    """The messages and extra template variables to render a tool request with.

    Args:
        messages: the request's OpenAI messages (not modified); assistant ``tool_calls`` are
            ``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``.
        spec: the checked tools (None: no tools). With choice "none" no tools are rendered,
            but tool history still is.
        fmt: the model's format.

    Returns:
        ``(messages, kwargs)``: normalized copies (``chat_template.normalize_messages``), and
        ``{"tools": spec.tools}`` for the formats whose templates render tools (``{}`` for
        GENERIC, whose tools go into a system message, and when no tools are offered). For
        HERMES/LLAMA3_JSON/MISTRAL call arguments become dicts (``tojson`` in the templates);
        LLAMA3_JSON splits a multi-call message into one message per call (its templates allow
        one); MISTRAL ids become 9 alphanumerics, distinct ones staying distinct. GENERIC's
        rewrite is in the module docstring.

    Raises:
        InvalidRequestError: param "messages": malformed messages or ``tool_calls``.
    """
    msgs, out, names, tool_run = normalize_messages(messages), [], {}, None
    active = spec is not None and spec.active
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = history_calls(m["tool_calls"], i)
            names.update((cid, name) for cid, name, _ in calls)
            if fmt is ToolFormat.GENERIC:
                obj = {"tool_calls": [{"name": n, "arguments": a} for _, n, a in calls]}
                obj |= {"content": m["content"]} if m.get("content") else {}
                out.append({"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)})
                continue
            shaped = [{"id": c, "type": "function", "function": {"name": n, "arguments": a}} for c, n, a in calls]
            groups = [[s] for s in shaped] if fmt is ToolFormat.LLAMA3_JSON else [shaped]
            out.extend({**m, "tool_calls": g} if k == 0 else {"role": "assistant", "content": "", "tool_calls": g}
                       for k, g in enumerate(groups))
        elif m["role"] == "tool" and fmt is ToolFormat.GENERIC:
            cid = m.get("tool_call_id")
            result = {"id": cid, "name": names.get(cid, m.get("name")), "content": m["content"]}
            line = json.dumps({"tool_response": result}, ensure_ascii=False)
            if tool_run is not None and tool_run == len(out) - 1:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + line}
            else:
                out.append({"role": "user", "content": line})
            tool_run = len(out) - 1
        else:
            out.append(m)
    if fmt is ToolFormat.MISTRAL:
        out = _with_mistral_ids(out)
    if not active:
        return out, {}
    if fmt is not ToolFormat.GENERIC:
        return out, {"tools": copy.deepcopy(spec.tools)}
    text = generic_system_prompt(spec)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + text}, *out[1:]], {}
    return [{"role": "system", "content": text}, *out], {}


def history_calls(calls: Any, i: int) -> list[tuple[str, str, Any]]:
    """``(id, name, arguments)`` of each call of an assistant message's ``tool_calls`` (message
    ``i``): arguments as a dict when its JSON text is an object, else as sent. OpenAI's rules for
    a history call, each a 400 in OpenAI's API too.

    Raises:
        InvalidRequestError: ``tool_calls`` not a list (param ``messages[i].tool_calls``), a call
            without ``function.name`` (param ``messages[i].tool_calls[k]``), a ``type`` other than
            ``function`` (param ``messages[i].tool_calls[k].type``), one whose ``id`` is
            missing, not a string or the id of an earlier call of the same message (param
            ``messages[i].tool_calls[k].id``: a tool message answers a call by its id), or whose
            ``function.arguments`` is missing or not a string (param
            ``messages[i].tool_calls[k].function.arguments``: OpenAI's arguments are JSON text,
            never a JSON object).
    """
    if not isinstance(calls, list):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    out: list[tuple[str, str, Any]] = []
    for k, tc in enumerate(calls):
        call = _history_call(tc, i, k)
        if any(call[0] == seen for seen, _, _ in out):
            raise InvalidRequestError(f"messages[{i}].tool_calls[{k}].id: duplicate id {call[0]!r} (the calls of "
                                      "one message need distinct ids: a tool message answers a call by its id)",
                                      f"messages[{i}].tool_calls[{k}].id")
        out.append(call)
    return out




def _history_call(tc: Any, i: int, k: int) -> tuple[str, str, Any]:
    """(id, name, arguments as a dict when its JSON text is an object) of one history call."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"messages[{i}].tool_calls[{k}]: each call needs function.name (a string)",
                                  f"messages[{i}].tool_calls[{k}]")
    if tc.get("type") not in (None, "function"):  # OpenAI's only call type (absent or null: vLLM's clients omit it)
        raise InvalidRequestError(f"messages[{i}].tool_calls[{k}].type must be 'function', got {tc.get('type')!r}",
                                  f"messages[{i}].tool_calls[{k}].type")
    if not isinstance(tc.get("id"), str):
        what = "is missing" if tc.get("id") is None else "must be a string"
        raise InvalidRequestError(f"messages[{i}].tool_calls[{k}].id {what}: a tool message answers a call by "
                                  "its id", f"messages[{i}].tool_calls[{k}].id")
    args = fn.get("arguments")
    if not isinstance(args, str):
        what = "is missing" if args is None else \
            f"must be a string (JSON text), got {json_kind(args)}"
        raise InvalidRequestError(f"messages[{i}].tool_calls[{k}].function.arguments {what}: a call's arguments "
                                  "are the JSON text of an object, as a reply's tool_calls carry them",
                                  f"messages[{i}].tool_calls[{k}].function.arguments")
    try:
        parsed = json.loads(args) if args.strip() else {}
        args = parsed if isinstance(parsed, dict) else args
    except JSON_ERRORS:  # not JSON, or nested past the recursion limit
        pass  # left as text: the template shows what the client sent
    return tc["id"], fn["name"], copy.deepcopy(args)


def _with_mistral_ids(msgs: list[dict]) -> list[dict]:
    """``msgs`` with each call id (assistant ``tool_calls`` and tool messages' ``tool_call_id``)
    rewritten to the 9 alphanumerics Mistral templates require (:func:`_mistral_ids`)."""
    ids = [tc["id"] for m in msgs if m["role"] == "assistant" for tc in m.get("tool_calls") or ()]
    ids += [str(m["tool_call_id"]) for m in msgs if m["role"] == "tool" and m.get("tool_call_id") is not None]
    short = _mistral_ids(ids)
    out = []
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [{**tc, "id": short[tc["id"]]} for tc in m["tool_calls"]]}
        elif m["role"] == "tool" and m.get("tool_call_id") is not None:
            m = {**m, "tool_call_id": short[str(m["tool_call_id"])]}
        out.append(m)
    return out


def _mistral_ids(ids: list[str]) -> dict[str, str]:
    """The 9-alphanumeric id of each call id of one conversation (Mistral templates require them).

    An id's last 9 alphanumerics, or a hash of it when it has fewer. Ids whose rewrites collide
    (``call_0_abcdefghijk`` and ``call_1_abcdefghijk``) each get a hash of the whole id instead,
    so distinct ids stay distinct; the same id maps the same way in its call and its tool result.

    Args:
        ids: the conversation's call ids, in order (repeats allowed).

    Returns:
        ``{id: 9 alphanumerics}``, one distinct value per distinct id; deterministic.
    """
    short = {cid: _last_nine(cid) for cid in dict.fromkeys(ids)}
    counts = Counter(short.values())
    taken = {s for s in short.values() if counts[s] == 1}
    for cid in short:
        if counts[short[cid]] > 1:
            salt = 0
            while (hashed := _hash_nine(cid, salt)) in taken:  # a hash meeting another id's: rehash
                salt += 1
            short[cid] = hashed
            taken.add(hashed)
    return short


def _last_nine(call_id: str) -> str:
    alnum = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return alnum[-9:] if len(alnum) >= 9 else _hash_nine(call_id, 0)


def _hash_nine(call_id: str, salt: int) -> str:
    data = call_id if salt == 0 else f"{call_id}\0{salt}"
    return hashlib.sha1(data.encode()).hexdigest()[:9]
