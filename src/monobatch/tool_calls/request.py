"""Tool requests: the checked ``tools`` / ``tool_choice`` fields and the model's tool format."""

from __future__ import annotations

import copy
import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any

from monobatch.errors import InvalidRequestError

#: OpenAI's tool (function) names: ``^[a-zA-Z0-9_-]{1,64}$``
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")

#: The string values of ``tool_choice`` (a function name is the fourth form).
CHOICES = ("none", "auto", "required")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN = "[TOOL_CALLS]"
#: Most calls in one reply where the grammar enforces the calls ("required"; GENERIC's "auto") and
#: ``parallel_tool_calls`` allows several: the list may end after each call, and must after this
#: many (a small model otherwise repeats a call until the context ends).
MAX_PARALLEL_CALLS = 8
#: The arguments schema of a tool declared without ``parameters``: a function that takes no
#: arguments (OpenAI's reading), so the grammar allows only ``{}``.
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """A checked tool request.

    Attributes:
        tools: ``[{"type": "function", "function": {"name", "description"?, "parameters"}}]``
            (HF's ``apply_chat_template(tools=...)`` shape; copies of the request's).
        choice: "none", "auto", "required" or the name of the one function to call.
        parallel: more than one call per reply is allowed (``parallel_tool_calls``).
    """

    tools: list = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are offered to the model (there are tools and the choice is not "none")."""
        return bool(self.tools) and self.choice != "none"

    @property
    def allowed(self) -> list[dict]:
        """The functions a call may name: the named one, else all."""
        fns = [t["function"] for t in self.tools]
        return fns if self.choice in CHOICES else [f for f in fns if f["name"] == self.choice]

    @property
    def max_calls(self) -> int:
        """Most calls one reply may hold: one for a named function (OpenAI forces exactly one
        call of it, whatever ``parallel_tool_calls`` says) or without ``parallel``, else
        :data:`MAX_PARALLEL_CALLS`."""
        return MAX_PARALLEL_CALLS if self.parallel and self.choice in CHOICES else 1


def check_tools(tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSpec:
    """Check OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` request fields.

    Args:
        tools: a list of ``{"type": "function", "function": {"name", "description"?,
            "parameters"?}}`` (``type`` may be left out; absent parameters are a function without
            arguments, :data:`NO_ARGUMENTS`). None or ``[]``: no tools.
        tool_choice: "none" | "auto" | "required" | ``{"type": "function", "function":
            {"name": ...}}``; None means "auto" with tools, "none" without (OpenAI's default).
        parallel_tool_calls: bool, default True.

    Returns:
        The :class:`ToolSpec`; with no tools its choice is "none".

    Raises:
        InvalidRequestError: param "tools" (not a list), or the path of the tool's field at fault,
            as OpenAI names it (``tools[1].function.name``: an element not an object, a type other
            than "function", a missing/empty/duplicate name, a non-string description, parameters
            not an object),
            "tool_choice" (an unknown string or shape, a name no tool has, "required" or a name
            without tools) or "parallel_tool_calls" (not a bool).
    """
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of tool objects", "tools")
    from monobatch.engine.constraint import MAX_TOOLS_SPEC_CHARS

    try:
        size = len(json.dumps(tools, ensure_ascii=False, default=str)) if tools else 0
    except RecursionError:  # nested past the recursion limit
        raise InvalidRequestError("tools: nested too deeply", "tools") from None
    except ValueError as exc:  # a circular reference (the Python API's objects)
        raise InvalidRequestError(f"tools: not JSON ({exc})", "tools") from None
    if size > MAX_TOOLS_SPEC_CHARS:  # before any grammar is built from them (a tool-call grammar's limit)
        raise InvalidRequestError(f"tools: {len(tools)} tools of {size} characters of JSON, more than the limit of "
                                  f"{MAX_TOOLS_SPEC_CHARS}: send fewer tools or shorter schemas", "tools")
    norm, names = [], set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object", where)
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object", f"{where}.function")
        name, desc, params = fn.get("name"), fn.get("description"), fn.get("parameters")
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if not _TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"{where}.function.name {name!r}: a tool name is 1 to 64 characters among "
                                      "a-z, A-Z, 0-9, '_' and '-' (OpenAI's rule)", f"{where}.function.name")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name: duplicate tool name {name!r}", f"{where}.function.name")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object",
                                      f"{where}.function.parameters")
        if params is not None:
            from monobatch.engine.constraint import check_exact_numbers

            check_exact_numbers(params, f"{where}.function.parameters")
        names.add(name)
        entry = {"name": name} | ({"description": desc} if desc is not None else {})
        entry["parameters"] = copy.deepcopy(params if params is not None else NO_ARGUMENTS)
        norm.append({"type": "function", "function": entry})
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice = tool_choice
    if choice is None:
        choice = "auto" if norm else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                      '"function": {"name": ...}}', "tool_choice")
        choice = fn["name"]
        if choice not in names:
            raise InvalidRequestError(f"tool_choice names {choice!r}, which is not one of the tools", "tool_choice")
    elif choice not in CHOICES:
        raise InvalidRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or a function object, "
                                  f"got {choice!r}", "tool_choice")
    if not norm and choice not in ("none", "auto"):
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools", "tool_choice")
    return ToolSpec(norm, choice if norm else "none", True if parallel_tool_calls is None else parallel_tool_calls)


def grammar_enforced(spec: "ToolSpec | None", fmt: "ToolFormat") -> bool:
    """Whether a grammar holds the reply to the tool format (:func:`~monobatch.tool_calls.tool_constraint`
    builds one): ``tool_choice`` "required" and a named function in every format, and GENERIC's
    "auto" (calls or ``{"response": ...}``, llama-server's choice). "auto" in a model's own format
    is free text, parsed afterwards; "none" and no tools constrain nothing."""
    return spec is not None and spec.active and (spec.choice != "auto" or fmt is ToolFormat.GENERIC)


class ToolFormat(enum.Enum):
    """How a model family writes tool calls (values are vLLM's parser names; see the module
    docstring for each one's exact text)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    GENERIC = "generic"


def detect_format(template_source: str | None) -> ToolFormat:
    """The tool format a chat template was written for.

    Args:
        template_source: the jinja2 chat template text, or None.

    Returns:
        MISTRAL when it mentions ``[TOOL_CALLS]`` (but not ``[ARGS]``, Mistral's newer
        ``name[ARGS]{...}`` form, which gets GENERIC); HERMES for ``<tool_call>`` (but not
        Qwen3-Coder's XML ``<function=``, GENERIC); LLAMA3_JSON for ``<|python_tag|>`` or
        ``"parameters"`` together with ``ipython``; GENERIC otherwise (templates that know no
        tools, such as the bundled SmolLM2's).
    """
    src = template_source or ""
    if MISTRAL_OPEN in src:
        return ToolFormat.GENERIC if "[ARGS]" in src else ToolFormat.MISTRAL
    if HERMES_OPEN in src:
        return ToolFormat.GENERIC if "<function=" in src else ToolFormat.HERMES
    if PYTHON_TAG in src or ('"parameters"' in src and "ipython" in src):
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.GENERIC
