"""Server parts without a server: the reasoning split (chat_output), request validation
messages, n>1 seeds and usage."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from monobatch.chat_output import ReasoningSplitter, prompt_opens_reasoning, split_reasoning
from monobatch.engine.params import SamplingParams
from monobatch.server.errors import validation_message
from monobatch.server.generation import Choice, build_requests, usage
from monobatch.server.protocol import ChatCompletionRequest, CompletionRequest


# -- reasoning split -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,in_reasoning,content,reasoning", [
    ("<think>\nplan it</think>\n\nThe answer.", False, "The answer.", "plan it"),
    ("  <think>a</think>b", False, "b", "a"),
    ("plan it\n</think>\nAnswer", True, "Answer", "plan it\n"),
    ("still thinking", True, "", "still thinking"),
    ("No reasoning here.", False, "No reasoning here.", ""),
    ("<thinking> is not the tag", False, "<thinking> is not the tag", ""),
    ("x </think> y", False, "x </think> y", ""),  # a close tag outside a block is text
    ("<thin", False, "<thin", ""),  # an unfinished tag at the end is text
    ("a</thi", True, "", "a</thi"),
])
def test_split_reasoning(text, in_reasoning, content, reasoning):
    out = split_reasoning(text, "separate", in_reasoning)
    assert (out.content, out.reasoning) == (content, reasoning)
    assert split_reasoning(text, "none", in_reasoning).content == text


@given(st.lists(st.sampled_from(["<", "think", ">", "</", "</think>", "<think>", "a", " ", "\n", "é", "t"]),
                max_size=20), st.booleans(), st.data())
def test_streamed_split_equals_whole_split(pieces, in_reasoning, data):
    """However the text is cut into pieces, the streamed deltas join to the whole-text split."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter = ReasoningSplitter("separate", in_reasoning)
    content, reasoning = "", ""
    for chunk in chunks:
        d = splitter.feed(chunk)
        content, reasoning = content + d.content, reasoning + d.reasoning
    d = splitter.flush()
    whole = split_reasoning(text, "separate", in_reasoning)
    assert (content + d.content, reasoning + d.reasoning) == (whole.content, whole.reasoning)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# -- validation messages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model,body,param,needle", [
    (CompletionRequest, {"prompt": 7}, "prompt", "prompt: invalid value"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    (CompletionRequest, {"prompt": "x", "frob": 1}, "frob", "unknown field"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias", "logit_bias.1"),
    (CompletionRequest, {}, "prompt", "prompt: Field required"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice",
     "not supported"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1.1,
                             "repeat_penalty": 1.2}, "repeat_penalty", "conflicts"),
])
def test_validation_messages_name_the_field(model, body, param, needle):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    message, got = validation_message(info.value.errors())
    assert got == param and needle in message


def test_nulls_are_absent():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": None,
                                                "temperature": None, "stream": None})
    assert req.temperature is None and req.stream is False


# -- n > 1 and usage ---------------------------------------------------------------------------------------
def test_choices_get_consecutive_seeds():
    reqs = build_requests("cmpl-x", [[1, 2], [3]], SamplingParams(seed=7), 2)
    assert [r.request_id for r in reqs] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2", "cmpl-x-3"]
    assert [r.params.seed for r in reqs] == [7, 8, 7, 8]
    assert all(r.params.seed is None for r in build_requests("c", [[1]], SamplingParams(), 3))


def test_usage_counts_each_prompt_once():
    choices = [Choice(i, num_prompt_tokens=p, num_output_tokens=o, num_cached_tokens=c)
               for i, (p, o, c) in enumerate([(5, 3, 0), (5, 4, 4), (2, 1, 0), (2, 1, 0)])]
    assert usage(choices, 2) == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16,
                                 "prompt_tokens_details": {"cached_tokens": 4}}
