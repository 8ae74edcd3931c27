"""Tool requests' output constraint: ``tool_choice`` "required" / a named function enforced by a grammar."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from monobatch.tool_calls.request import (HERMES_CLOSE, HERMES_OPEN, MISTRAL_OPEN, ToolFormat, ToolSpec,
                                         grammar_enforced)

if TYPE_CHECKING:
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.tokenizer import Tokenizer

#: ``%json`` options inside Lark grammars (the json_schema kind gets them from the compiler).
_LARK_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_constraint(spec: ToolSpec | None, fmt: ToolFormat, tokenizer: "Tokenizer | None" = None
                    ) -> "StructuredOutput | None":
    """The output constraint for a tool request.

    "required" and a named function are enforced: the reply must be calls of allowed tools whose
    arguments match their ``parameters`` schema: exactly one for a named function or without
    ``parallel``, else one to :data:`~monobatch.tool_calls.request.MAX_PARALLEL_CALLS`, the list
    allowed to end after each call (``spec.max_calls``). GENERIC gets a ``json_schema`` (for
    "auto" too: calls or ``{"response": string}``, as llama-server does); the other formats a
    ``lark`` grammar with ``%json`` schemas. "auto" for them and "none" get None (free generation,
    parsed afterwards).

    Args:
        spec: the checked tools (None: no tools).
        fmt: the model's format.
        tokenizer: when given, a marker that is one special token of its vocabulary is matched as
            that token (``<[id]>``); otherwise, and without a tokenizer, as text.

    Returns:
        The :class:`~monobatch.engine.constraint.StructuredOutput` (param "tools"), or None.
    """
    from monobatch.engine.constraint import MAX_TOOLS_SPEC_CHARS, StructuredOutput

    if not grammar_enforced(spec, fmt):
        return None
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    defs, calls = {}, []
    for i, fn in enumerate(spec.allowed):
        defs[f"tool{i}"] = _relocate_refs(fn["parameters"], f"#/$defs/tool{i}")
        args = {"type": "object", "$ref": f"#/$defs/tool{i}"}  # an object even when parameters is {}
        calls.append(_obj({"name": {"type": "string", "const": fn["name"]}, key: args}))
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    index = {t["function"]["name"]: i for i, t in enumerate(spec.tools)}
    parts = tuple(StructuredOutput("json_schema", json.dumps(fn["parameters"], ensure_ascii=False),
                                   f"tools[{index[fn['name']]}].function.parameters", MAX_TOOLS_SPEC_CHARS)
                  for fn in spec.allowed)  # a refused grammar names the tool whose schema it is
    if fmt is ToolFormat.GENERIC:
        items = {"type": "array", "items": call, "minItems": 1, "maxItems": spec.max_calls}
        schema = _obj({"tool_calls": items})
        if spec.choice == "auto":
            schema = {"anyOf": [schema, _obj({"response": {"type": "string"}})]}
        return StructuredOutput("json_schema", json.dumps({"$defs": defs, **schema}, ensure_ascii=False), "tools",
                                MAX_TOOLS_SPEC_CHARS, parts)
    args = "args: %json " + json.dumps({"$defs": defs, **call, "x-guidance": _LARK_JSON}, ensure_ascii=False)

    def lit(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
        return f"<[{ids[0]}]>" if len(ids) == 1 and tokenizer.is_special(ids[0]) else json.dumps(text)

    bound = f"{{0,{spec.max_calls - 1}}}"  # the further calls: the grammar may end after each one
    more = {ToolFormat.HERMES: ' ("\\n" call)', ToolFormat.MISTRAL: ' (", " args)',
            ToolFormat.LLAMA3_JSON: ' ("; " args)'}[fmt] + bound if spec.max_calls > 1 else ""
    if fmt is ToolFormat.HERMES:
        start = f'start: call{more}\ncall: {lit(HERMES_OPEN)} "\\n" args "\\n" {lit(HERMES_CLOSE)}'
    elif fmt is ToolFormat.MISTRAL:
        start = f'start: {lit(MISTRAL_OPEN)} "[" args{more} "]"'
    else:
        start = f"start: args{more}"
    return StructuredOutput("lark", f"{start}\n{args}\n", "tools", MAX_TOOLS_SPEC_CHARS, parts)


def _obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _relocate_refs(node: Any, base: str) -> Any:
    """A copy of a schema with its local ``$ref``s ("#...") pointing under ``base``."""
    if isinstance(node, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _relocate_refs(v, base) for k, v in node.items()}
    return [_relocate_refs(v, base) for v in node] if isinstance(node, list) else node
