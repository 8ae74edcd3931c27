"""Chat templates: rendering equals transformers', one BOS (field case F2), 400-class errors."""

from __future__ import annotations

import gguf
import pytest

from monobatch.errors import InvalidRequestError
from monobatch.tokenizer import ChatTemplate, Tokenizer, load_chat_template, normalize_messages

# fixtures and helpers (tests/ is on sys.path via conftest.py)
from fixtures_tokenizer import (copy_gguf_with_metadata, hf_smollm, open_reader, smollm_reader,  # noqa: F401
                                smollm_tokenizer, write_bpe_gguf)



CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, in Japanese: 色 please 🎨"}],
    [{"role": "user", "content": "  spaces\n\nand newlines\t"}],
    [{"role": "user", "content": ""}],
]
ASSISTANT_HEADER = "<|im_start|>assistant\n"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_ids_match_hf(smollm_tokenizer, hf_smollm, messages, add_generation_prompt):
    text = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = smollm_tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_smollm.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == (hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids)
    assert text.endswith(ASSISTANT_HEADER) is add_generation_prompt


HF_FEATURES = ("{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2) }}{% endfor %}"
               "{% if tools is none %}no-tools{% endif %}{{ bos_token }}{{ eos_token }}"
               "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
               "{{ strftime_now('%Y') | length }}")


def test_template_features_match_hf(smollm_tokenizer, hf_smollm):
    """tojson (non-ASCII kept, indent), tools=None, bos/eos text, loop controls, strftime_now."""
    messages = [{"role": "user", "content": "héllo 日本 \"quoted\" <b>"}]
    original = smollm_tokenizer.chat_template
    smollm_tokenizer.set_chat_template(HF_FEATURES)
    try:
        ours = smollm_tokenizer.apply_chat_template(messages)
    finally:
        smollm_tokenizer.set_chat_template(original)
    assert ours == hf_smollm.apply_chat_template(messages, chat_template=HF_FEATURES, tokenize=False,
                                                 add_generation_prompt=True)
    assert "日本" in ours and "<|im_start|><|im_end|>" in ours


def test_extra_variables_and_text_parts():
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ flavour }}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert template.render(messages, flavour="!") == "[user:a\nb][assistant:]!"
    assert messages[0]["content"][0] == {"type": "text", "text": "a"}  # the caller's messages untouched


@pytest.mark.parametrize("messages, match", [
    ({}, "list"),
    (["hi"], "object"),
    ([{"role": "wizard", "content": "hi"}], "role"),
    ([{"content": "hi"}], "role"),
    ([{"role": "user", "content": None}], "content"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": 7}], "string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
])
def test_malformed_messages(smollm_tokenizer, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        smollm_tokenizer.encode_chat(messages)


def test_template_errors_are_invalid_requests():
    with pytest.raises(InvalidRequestError) as raised:
        ChatTemplate("{{ raise_exception('Conversation roles must alternate user/assistant') }}").render([])
    assert str(raised.value) == "Conversation roles must alternate user/assistant"
    with pytest.raises(InvalidRequestError, match="chat template error"):
        ChatTemplate("{{ messages[3]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="chat template error"):  # the sandbox refuses
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(InvalidRequestError, match="does not compile"):
        ChatTemplate("{% for %}")
    assert normalize_messages([{"role": "tool", "content": "42", "tool_call_id": "a", "name": None}]) == [
        {"role": "tool", "content": "42", "tool_call_id": "a"}]


def test_bad_role_error_lists_every_accepted_role(smollm_tokenizer):
    """The list names `developer` too (OpenAI's newer `system`, which the template gets as
    `system`), in every client of the template, not only the server."""
    with pytest.raises(InvalidRequestError) as raised:
        smollm_tokenizer.encode_chat([{"role": "wizard", "content": "hi"}])
    assert str(raised.value) == ("messages[0].role must be one of ['assistant', 'developer', 'system', 'tool', "
                                 "'user'], got 'wizard'")
    assert normalize_messages([{"role": "developer", "content": "Be brief."}]) == [
        {"role": "system", "content": "Be brief."}]
    as_developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert smollm_tokenizer.apply_chat_template(as_developer) == smollm_tokenizer.apply_chat_template(as_system)


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_bpe_gguf(tmp_path / "v.gguf", "gpt-2")))
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    tok.set_chat_template("{{ messages[0].content }}")
    assert tok.encode_chat([{"role": "user", "content": " the"}]) == tok.encode(" the")
    with pytest.raises(InvalidRequestError):
        tok.set_chat_template("{% if %}")


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'x' }}", encoding="utf-8")
    assert load_chat_template(None, None) is None
    assert load_chat_template("{{ 'y' }}", None) == "{{ 'y' }}"
    assert load_chat_template(None, path) == "{{ 'x' }}"
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load_chat_template(None, tmp_path / "missing.jinja")
    with pytest.raises(InvalidRequestError, match="not both"):
        load_chat_template("x", path)
    with pytest.raises(InvalidRequestError, match="does not compile"):
        load_chat_template("{% endfor %}", None)


# -- field case F2: one BOS ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bos_writing_models(tmp_path_factory, smollm_reader):
    """Copies of the bundled GGUF with add_bos_token=True and a template that writes ``{{ bos_token }}``.

    ``plain``: only those two fields change (this model's BOS is ``<|im_start|>``, id 1).
    ``distinct``: BOS is also set to ``<|endoftext|>`` (id 0), a BOS unlike the turn marker, as in
    Llama 3 (``<|begin_of_text|>``).
    """
    template = "{{ bos_token }}" + smollm_reader.fields["tokenizer.chat_template"].contents()
    root = tmp_path_factory.mktemp("f2")
    overrides = {"tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": template}
    plain = copy_gguf_with_metadata(smollm_reader, root / "plain.gguf", overrides)
    distinct = copy_gguf_with_metadata(smollm_reader, root / "distinct.gguf",
                                       {**overrides, "tokenizer.ggml.bos_token_id": 0})
    return {name: Tokenizer.from_gguf(open_reader(path)) for name, path in
            [("plain", plain), ("distinct", distinct)]}


@pytest.mark.parametrize("messages", CONVERSATIONS[:3])
def test_f2_single_bos(bos_writing_models, messages):
    """F2: a template that writes the BOS gets no second one from tokenization; the prompt ends
    with the assistant header; chat ids equal the ids of the rendered prompt sent as a completion."""
    distinct = bos_writing_models["distinct"]
    assert distinct.add_bos and distinct.bos_id == 0
    text = distinct.apply_chat_template(messages)
    assert text.startswith("<|endoftext|><|im_start|>") and text.endswith(ASSISTANT_HEADER)
    ids = distinct.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1 and ids[1] == 1
    header = distinct.encode(ASSISTANT_HEADER, add_special_tokens=False)
    assert ids[-len(header):] == header
    assert ids == distinct.encode(text)  # the /v1/completions path with the rendered prompt

    plain = bos_writing_models["plain"]  # BOS text == "<|im_start|>": exactly the template's own ids
    text = plain.apply_chat_template(messages)
    assert text.startswith("<|im_start|><|im_start|>system")
    assert plain.encode_chat(messages) == plain.encode(text, add_special_tokens=False)


def test_f2_bos_added_when_template_omits_it(bos_writing_models, smollm_tokenizer):
    """add_bos with a template that does not write BOS: tokenization adds exactly one."""
    tok = bos_writing_models["distinct"]
    original = tok.chat_template
    tok.set_chat_template(smollm_tokenizer.chat_template)
    try:
        messages = CONVERSATIONS[0]
        assert tok.encode_chat(messages) == [0] + smollm_tokenizer.encode_chat(messages)
    finally:
        tok.set_chat_template(original)


def test_f2_raise_exception_message(bos_writing_models):
    tok = bos_writing_models["plain"]
    original = tok.chat_template
    tok.set_chat_template("{% if messages[0]['role'] != 'user' %}{{ raise_exception('First message must be "
                          "from the user') }}{% endif %}{{ bos_token }}{{ messages[0]['content'] }}")
    try:
        with pytest.raises(InvalidRequestError) as raised:
            tok.encode_chat([{"role": "assistant", "content": "hi"}])
        assert str(raised.value) == "First message must be from the user"
        assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [1] + tok.encode("hi", add_special_tokens=False)
    finally:
        tok.set_chat_template(original)
