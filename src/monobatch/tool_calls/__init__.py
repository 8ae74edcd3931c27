"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` for chat models (pure: no HTTP, no engine).

The pieces, in the order a request meets them (one file each):

- :func:`check_tools` checks the request fields into a :class:`ToolSpec`; :func:`detect_format`
  picks the model's :class:`ToolFormat` from its chat template text (``request.py``).
- :func:`prepare_messages` returns the messages and template kwargs to render: tools, tool-call
  history (``prompt.py``).
- :func:`tool_constraint` returns the :class:`~monobatch.engine.constraint.StructuredOutput`
  that enforces ``tool_choice`` "required" / a named function, and GENERIC's "auto"
  (``constraint.py``).
- :class:`ToolCallParser` splits the reply's streamed text into content and tool calls;
  :func:`parse_tool_calls` is its whole-text form (``parser.py``).

A chat door uses them like this::

    spec = check_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    fmt = detect_format(tokenizer.chat_template)
    messages, kwargs = prepare_messages(body["messages"], spec, fmt)
    prompt = tokenizer.apply_chat_template(messages, **kwargs)
    structured = tool_constraint(spec, fmt, tokenizer)  # None: free generation
    parser = ToolCallParser(spec, fmt)                  # feed() each text piece, then flush(finish_reason)
    # "tool_calls" only when the engine ended normally after complete calls, and tool_choice did
    # not name the function (OpenAI answers "stop" then): ChatPrompt.finish_reason
    if parser.has_calls and not parser.cut and finish_reason == "stop" and spec.choice in CHOICES:
        finish_reason = "tool_calls"

Formats (what the model writes; markers are matched in the reply text, so a marker that is a
special token -- Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>`` -- must be decoded with
``skip_special_tokens=False``):

- HERMES (Hermes 2 Pro / 3, Qwen2, Qwen2.5, Qwen3; vLLM's ``hermes`` parser):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated for parallel calls;
  text before and between calls is content.
- LLAMA3_JSON (Llama 3.1 / 3.2 / 3.3 JSON tool calling; vLLM's ``llama3_json``): the reply is
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several joined by
  ``;``. A reply that starts otherwise is content.
- MISTRAL (Mistral v3+ templates; vLLM's ``mistral``):
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. History tool-call ids are rewritten to
  the 9 alphanumerics Mistral templates require.
- GENERIC (llama-server's generic format, for templates that know no tools): a system message
  (:func:`generic_system_prompt`; the first system message is extended, or one is prepended)
  lists the tools and asks for exactly one JSON object::

      {"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}   to call tools
      {"response": "<reply text>"}                                           to answer in text

  ``tool_calls`` has one item for a named function or without ``parallel_tool_calls``, else at
  most ``MAX_PARALLEL_CALLS`` (the grammar's bound, every format). In history an assistant
  message with ``tool_calls`` becomes assistant content ``{"tool_calls": [...]}`` (plus ``"content"`` when it had
  text); consecutive ``tool`` messages become one user message, one line per result:
  ``{"tool_response": {"id": "<tool_call_id>", "name": "<tool name>", "content": "<result>"}}``.

Parser decisions: a call is reported once its JSON object is complete and valid, as one delta
carrying index, id, name and the whole ``arguments`` (the canonical ``json.dumps`` of the
arguments object, ``ensure_ascii=False``), so streamed and whole-text parses agree exactly (field
case G1). A call ``max_tokens`` cut before its JSON ended (the engine's ``length``, passed to
``flush``) is reported at the end of the reply when its name was complete, its ``arguments`` the
arguments' text as far as it came (not JSON: OpenAI's reply when ``max_tokens`` cuts a forced
call); cut before its name, it is no call, and its text is dropped where a grammar forced the
format (:func:`grammar_enforced`: the wrapper) or content, markers included, under "auto" in a
model's own format (as vLLM does). A call a stop string cut (``stop``, also a complete named call's
reason) is no call: its text is content, markers included. The parser's ``cut`` says the reply
ended inside a call (``finish_reason`` stays the engine's); calls complete before it stay calls (a
stream has sent them already). A dangling partial marker (``<tool_ca``, two or more characters) at
the very end is dropped (G2).
"""

from monobatch.tool_calls.constraint import tool_constraint
from monobatch.tool_calls.parser import (ToolCall, ToolCallDelta, ToolCallParser, ToolDelta, new_call_id,
                                         parse_tool_calls)
from monobatch.tool_calls.prompt import generic_system_prompt, history_calls, prepare_messages
from monobatch.tool_calls.request import (CHOICES, MAX_PARALLEL_CALLS, NO_ARGUMENTS, ToolFormat, ToolSpec, check_tools,
                                          detect_format, grammar_enforced)

__all__ = ["CHOICES", "MAX_PARALLEL_CALLS", "NO_ARGUMENTS", "ToolCall", "ToolCallDelta", "ToolCallParser",
           "ToolDelta", "ToolFormat", "ToolSpec", "check_tools", "detect_format", "generic_system_prompt",
           "grammar_enforced", "history_calls", "new_call_id", "parse_tool_calls", "prepare_messages",
           "tool_constraint"]
