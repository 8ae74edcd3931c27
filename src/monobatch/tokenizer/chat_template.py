"""Chat templates: a model's jinja2 template turned into the prompt text for a conversation.

The rendering environment copies Hugging Face's (transformers ``utils/chat_template_utils.py``,
"HF chat templates"): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, the globals ``raise_exception`` and
``strftime_now``, and a ``tojson`` filter that keeps non-ASCII text and takes ``indent``. The
variables a template sees are ``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``, ``tools`` and ``documents`` (both None unless given), plus any extra keyword.

Every failure a request can cause -- no template, a malformed message, a template's own
``raise_exception(msg)``, any error while rendering -- is an ``InvalidRequestError`` (HTTP 400),
never an unhandled exception (field case F2).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from monobatch.errors import InvalidRequestError, require_file_name

#: Roles a message may have (OpenAI chat roles minus the deprecated ``function``); ``developer``
#: (OpenAI's newer name for ``system``) reaches the template as ``system``.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class TemplateRaised(jinja2.TemplateError):
    """A template called ``raise_exception(message)``; the message is the user-facing error."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's override: jinja's built-in tojson HTML-escapes and cannot indent.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    """Compile ``source`` once; templates are keyed by their text (HF caches the same way)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """One compiled chat template.

    Args:
        source: the jinja2 template text (GGUF ``tokenizer.chat_template``, HF
            ``tokenizer_config.json`` ``chat_template`` or ``chat_template.jinja``).

    Raises:
        InvalidRequestError: the template does not compile (a bad ``--chat-template``).
    """

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise InvalidRequestError("chat template is empty", param="chat_template")
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"chat template does not compile: {exc} (line {exc.lineno})",
                                      param="chat_template") from exc
        self.source = source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               bos_token: str | None = None, eos_token: str | None = None, **kwargs: Any) -> str:
        """Render a conversation to prompt text.

        Args:
            messages: OpenAI-style messages, checked and normalized by :func:`normalize_messages`.
            add_generation_prompt: append the assistant header so the model answers next.
            bos_token / eos_token: the token texts templates refer to (``{{ bos_token }}``).
            **kwargs: extra template variables (``tools``, ``documents``, ``enable_thinking`` ...).

        Returns:
            The rendered prompt text; special tokens appear as their text.

        Raises:
            InvalidRequestError: malformed messages; the template's ``raise_exception(msg)``
                (the message is kept verbatim); any other error while rendering.
        """
        variables = {"tools": None, "documents": None, **kwargs}
        try:
            return self._template.render(messages=normalize_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "",
                                         **variables)
        except InvalidRequestError:
            raise
        except TemplateRaised as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc
        except Exception as exc:  # a template bug or input it cannot handle: still the request's 400
            raise InvalidRequestError(f"chat template error: {type(exc).__name__}: {exc}",
                                      param="messages") from exc


def normalize_messages(messages: Any) -> list[dict]:
    """Check OpenAI-style chat messages and put them in the shape templates expect.

    Each message is a dict with ``role`` in :data:`ROLES` (``developer`` becomes ``system``).
    ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts, joined with
    ``"\\n"`` (as vLLM and llama.cpp's server do for text-only templates). An assistant message
    with ``tool_calls`` may have no content. Keys whose value is None are dropped (HF does the
    same: templates test for a key's presence).
    Other keys (``name``, ``tool_calls``, ``tool_call_id``, ...) pass through unchanged.

    Args:
        messages: the request's ``messages``.

    Returns:
        New message dicts; the caller's are not modified.

    Raises:
        InvalidRequestError: not a list (param ``messages``), a message not a dict (param
            ``messages[i]``), an unknown role (``messages[i].role``), missing or non-text content
            (``messages[i].content``): the element at fault, as OpenAI names it.
    """
    if not isinstance(messages, list):
        raise InvalidRequestError("messages must be a list of message objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}",
                                      param=f"messages[{i}].role")
        clean = {key: value for key, value in message.items() if value is not None}
        if role == "developer":
            clean["role"] = "system"
        content = message.get("content")
        if content is None:
            if not (role == "assistant" and message.get("tool_calls")):
                raise InvalidRequestError(f"messages[{i}].content is missing", param=f"messages[{i}].content")
        else:
            clean["content"] = _content_text(content, i)
        out.append(clean)
    return out


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts",
                                  param=f"messages[{index}].content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"messages[{index}].content: unsupported part {kind!r} (only text parts)",
                                      param=f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def load_chat_template(template: str | None = None, template_file: str | Path | None = None) -> str | None:
    """Resolve the ``--chat-template`` / ``--chat-template-file`` overrides to template text.

    Args:
        template: template text given inline, or None.
        template_file: path of a file holding the template, or None.

    Returns:
        The template text, or None when neither is given (keep the model's own).

    Raises:
        InvalidRequestError: both given, the file is missing or unreadable, or the text does
            not compile.
    """
    if template is not None and template_file is not None:
        raise InvalidRequestError("give --chat-template or --chat-template-file, not both",
                                  param="chat_template")
    if template_file is not None:
        require_file_name(template_file, "--chat-template-file")
        try:
            template = Path(template_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidRequestError(f"cannot read chat template file {str(template_file)!r}: "
                                      f"{exc.strerror or exc}", param="chat_template_file") from exc
    if template is not None:
        ChatTemplate(template)  # compile now so a bad flag fails at startup
    return template
