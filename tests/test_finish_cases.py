"""Field cases at the engine level, on the real bundled model (greedy): stop strings held across
tokens (S1), held-back prefixes released once (S2), multibyte characters split across tokens (T1),
which tokens each penalty counts (P1), loop detection, min_tokens / ignore_eos / stop_token_ids.

Every concrete string is derived from a first greedy reference run of the model; nothing the
model generates is hard-coded. Each precondition a test relies on is asserted in the test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from monobatch.batch import StepBatch
from helpers import near_tie, new_scheduler
from monobatch.engine.finish import FinishStep, LOOP_MAX_PERIOD, RowOutput
from monobatch.engine.params import SamplingParams
from monobatch.engine.sampler import RowSampler, SamplerState
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import FinishReason, Request
from monobatch.engine.stop import StopMatcher
from monobatch.kv.dense import DenseKv

#: The raw prompt whose greedy reference the stop-string cases cut (ASCII prose, multi-char tokens).
STORY = "Once upon a time, in a small village"
#: A suffix the model never writes: appended to an output's text it makes a stop string whose
#: prefix occurs but whose whole never does (S2). Asserted absent from every reference.
NEVER = "@#"
REF_TOKENS = 24
FFFD = "\ufffd"


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# -- driving the engine ----------------------------------------------------------------------



def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@dataclass
class Run:
    """What a request produced: every RowOutput, and the deltas grouped by scheduler step."""

    outs: list[RowOutput]
    steps: list[str]  # the request's text delta of each step it produced output in

    @property
    def ids(self) -> list[int]:
        return [t for o in self.outs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outs)

    @property
    def final(self) -> RowOutput:
        return self.outs[-1]


def drive(sched: BatchScheduler, requests: list[Request], streamed: bool = True,
          focus: str | None = None) -> dict[str, Run]:
    """Run ``requests`` to the end. ``streamed``: step by step, recording each step's delta (what an
    SSE client sees); otherwise through ``BatchScheduler.run`` (what a non-streaming client joins).
    When request ``focus`` finishes, the others are aborted (they only had to share its batch)."""
    runs = {r.request_id: Run([], []) for r in requests}

    def route(o: RowOutput) -> None:
        runs[o.request_id].outs.append(o)
        runs[o.request_id].steps.append(o.text)
        if o.finished and o.request_id == focus:
            for rid, run in runs.items():
                if rid != focus and not any(x.finished for x in run.outs):
                    assert sched.abort(rid)

    if streamed:
        for r in requests:
            sched.add_request(r)
        while sched.has_unfinished():
            for o in sched.step():
                route(o)
    else:
        for o in sched.run(requests):
            route(o)
    for rid, run in runs.items():
        finals = [o for o in run.outs if o.finished]
        assert len(finals) == 1 and run.outs[-1] is finals[0], f"{rid}: exactly one final output, last"
    return runs


def neighbours(loaded) -> list[Request]:
    """Two requests with other prompts and settings that share the batch with the one under test."""
    tok = loaded.tokenizer
    return [
        Request("n-greedy", tok.encode("The quick brown fox"), greedy(max_tokens=20, stop=(".",))),
        Request("n-sampled", tok.encode_chat([{"role": "user", "content": "Say hello."}]),
                SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=7, repeat_penalty=1.2,
                               presence_penalty=0.5)),
    ]


def generate(loaded, prompt_ids: list[int], params: SamplingParams, batched: bool = False,
             streamed: bool = True) -> Run:
    """The request alone (B=1) or beside :func:`neighbours`."""
    req = Request("x", prompt_ids, params)
    others = neighbours(loaded) if batched else []
    return drive(new_scheduler(loaded), [others[0], req, *others[1:]] if batched else [req], streamed,
                 focus="x")["x"]


def token_texts(tok, ids: list[int]) -> list[str]:
    """Each token's own text; the reference's tokens must each be whole UTF-8 (asserted)."""
    return [tok.token_bytes(i).decode("utf-8") for i in ids]


def same_tokens_or_near_tie(loaded, prompt, ref: list[int], got: list[int]) -> bool:
    """True when ``got`` is a prefix of ``ref``; else asserts the divergence is a near-tie (C1
    default mode) and returns False (the caller then checks against ``got`` only)."""
    if got == ref[:len(got)]:
        return True
    i = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    margin = top2_margin(loaded, prompt + ref[:i])
    assert margin < near_tie(loaded), f"greedy diverged from the reference at {i} with top-2 margin {margin}"
    return False


def first_logits(loaded, ids: list[int]) -> torch.Tensor:
    """The model's logits for the token after ``ids`` (B=1, dense), ``[1, V]`` float32."""
    a = loaded.model.args
    kv = DenseKv(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, len(ids) + 1,
                 loaded.model.dtype, loaded.model.device)
    batch = StepBatch.build([(0, ids, 0, True)])
    kv.prepare(batch)
    with torch.inference_mode():
        return loaded.model(batch, kv).float()


def top2_margin(loaded, ids: list[int]) -> float:
    top = first_logits(loaded, ids)[0].topk(2).values
    return float(top[0] - top[1])


# -- references -------------------------------------------------------------------------------

@dataclass
class Reference:
    prompt: list[int]
    ids: list[int]
    texts: list[str]  # per-token text
    text: str
    finish: FinishReason

    @property
    def starts(self) -> list[int]:
        """Character offset of each token's text in ``text``."""
        out, at = [], 0
        for t in self.texts:
            out.append(at)
            at += len(t)
        return out

    def spanned(self, start: int, end: int) -> list[int]:
        """Indices of the tokens whose text overlaps characters ``[start, end)``."""
        return [i for i, (s, t) in enumerate(zip(self.starts, self.texts)) if s < end and start < s + len(t)]


def reference(loaded, prompt: list[int], max_tokens: int) -> Reference:
    run = generate(loaded, prompt, greedy(max_tokens=max_tokens))
    ids = run.ids
    texts = token_texts(loaded.tokenizer, [i for i in ids if i not in loaded.tokenizer.eog_ids])
    assert run.text == "".join(texts) == loaded.tokenizer.decode(ids)
    return Reference(prompt, ids, texts, run.text, run.final.finish_reason)


@pytest.fixture(scope="module")
def story(loaded) -> Reference:
    ref = reference(loaded, loaded.tokenizer.encode(STORY), REF_TOKENS)
    assert ref.finish is FinishReason.LENGTH and len(ref.ids) == REF_TOKENS
    assert NEVER not in ref.text
    return ref


@pytest.fixture(scope="module")
def chat_eos(loaded) -> Reference:
    """A chat reply that ends by itself (end-of-generation id) well before its cap."""
    ref = reference(loaded, loaded.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}]), 40)
    assert ref.finish is FinishReason.STOP and ref.ids[-1] in loaded.tokenizer.eog_ids
    assert len(ref.ids) >= 6 and NEVER not in ref.text
    return ref


# -- S1: stop strings held across tokens ------------------------------------------------------

def pick_stop(ref: Reference, kind: str) -> str:
    """A stop string of ``kind`` whose FIRST occurrence in the reference is where it was cut from.

    inside: strictly inside one multi-character token; two / three: spanning exactly 2 / 3
    tokens (the 3-token one ends mid-token); mid: starting mid-token (and ending in the next).
    Different kinds start their search at different tokens so they cut at different places.
    """
    t, s = ref.texts, ref.starts
    first = {"inside": 1, "two": 2, "three": 4, "mid": 6}[kind]
    for i in range(first, len(t) - 3):
        if kind == "inside" and len(t[i]) >= 4:
            stop, at = t[i][1:-1], s[i] + 1
        elif kind == "two" and len(t[i]) >= 2 and len(t[i + 1]) >= 2:
            stop, at = t[i] + t[i + 1], s[i]
        elif kind == "three" and len(t[i + 2]) >= 2:
            stop, at = t[i] + t[i + 1] + t[i + 2][:-1], s[i]
        elif kind == "mid" and len(t[i]) >= 3:
            stop, at = t[i][len(t[i]) // 2:] + t[i + 1], s[i] + len(t[i]) // 2
        else:
            continue
        if ref.text.find(stop) == at and stop.strip():
            return stop
    raise AssertionError(f"no {kind} stop string in the reference {ref.text!r}")


S1_KINDS = ["inside", "two", "three", "mid"]


@pytest.fixture(scope="module")
def s1_stops(story) -> dict[str, str]:
    stops = {k: pick_stop(story, k) for k in S1_KINDS}
    for kind, stop in stops.items():
        at = story.text.find(stop)
        spanned = story.spanned(at, at + len(stop))
        token_start = story.starts[spanned[0]]
        if kind == "inside":
            assert len(spanned) == 1 and at > token_start
            assert at + len(stop) < token_start + len(story.texts[spanned[0]])
        if kind == "two":
            assert len(spanned) == 2
        if kind == "three":
            assert len(spanned) == 3
        if kind == "mid":
            assert at > token_start and len(spanned) >= 2
        assert at > 0 and story.text.count(stop, 0, at + len(stop)) == 1  # not earlier
    return stops


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop"])
@pytest.mark.parametrize("mode", ["streamed", "final"])
@pytest.mark.parametrize("batched", [False, True], ids=["B1", "batched"])
@pytest.mark.parametrize("kind", S1_KINDS)
def test_s1_stop_string_across_tokens(loaded, story, s1_stops, kind, batched, mode, include):
    """S1: a stop string inside one token, spanning 2 and 3 tokens, or starting mid-token ends the
    text just before it (or just after it with include_stop_str_in_output), finish_reason stop;
    streamed deltas never show a stop prefix that is later retracted; B=1 and batched."""
    stop = s1_stops[kind]
    run = generate(loaded, story.prompt, greedy(max_tokens=REF_TOKENS, stop=(stop,),
                                                include_stop_str_in_output=include),
                   batched=batched, streamed=mode == "streamed")
    assert run.final.finish_reason is FinishReason.STOP
    ids = run.ids
    if same_tokens_or_near_tie(loaded, story.prompt, story.ids, ids):
        full = story.text
    else:
        full = loaded.tokenizer.decode(ids)
    at = full.find(stop)
    assert at >= 0
    expected = full[:at + len(stop)] if include else full[:at]
    assert run.text == expected
    # generation stopped at the token that completed the stop string, not later
    completed = loaded.tokenizer.decode(ids)
    assert stop in completed and stop not in loaded.tokenizer.decode(ids[:-1])
    assert run.final.num_output_tokens == len(ids)
    if include:
        assert run.text.endswith(stop)
    if mode == "streamed":
        emitted = ""
        for delta in run.steps:
            emitted += delta
            assert expected.startswith(emitted), f"delta {delta!r} shows text later retracted"
        assert emitted == expected


@pytest.mark.parametrize("kind", S1_KINDS)
def test_s1_stop_completed_on_the_last_allowed_token(loaded, story, s1_stops, kind):
    """S1: when the token that completes the stop string is also the max_tokens-th, the text is
    cut before the stop string and finish_reason is stop (the stop string matched)."""
    stop = s1_stops[kind]
    at = story.text.find(stop)
    k = story.spanned(at, at + len(stop))[-1] + 1  # the token that completes the stop string
    run = generate(loaded, story.prompt, greedy(max_tokens=k, stop=(stop,)))
    assert len(run.ids) == k and run.text == story.text[:at]
    assert run.final.finish_reason is FinishReason.STOP


# -- S2: a held-back prefix is released exactly once ------------------------------------------

def held_after(texts: list[str], stop: str) -> str:
    """What a stop matcher holds after the per-token texts ``texts`` (a precondition helper)."""
    m = StopMatcher([stop])
    for t in texts:
        m.feed(t)
    return m.held


def held_at_some_step(run: Run, tok) -> bool:
    """True when, after some step, less text was emitted than the tokens so far decode to (a
    prefix was held back); the run's tokens are whole UTF-8 here, so only a stop prefix holds."""
    emitted, ids = "", []
    for o in run.outs[:-1]:
        emitted += o.text
        ids += o.token_ids
        if len(emitted) < len(tok.decode(ids)):
            return True
    return False


@pytest.mark.parametrize("batched", [False, True], ids=["B1", "batched"])
@pytest.mark.parametrize("where", ["token_start", "mid_token"])
def test_s2_failed_prefix_released_once_mid_stream(loaded, story, where, batched):
    """S2: a stop string whose first characters (a token's text, or its second half) occur in the
    output but whose whole never does: held back, then released exactly once -- the joined text
    is the reference, no duplicate, no loss; finish_reason length."""
    i = 5 + (3 if where == "mid_token" else 0)
    while len(story.texts[i]) < 3:
        i += 1
    piece = story.texts[i] if where == "token_start" else story.texts[i][1:]
    stop = piece + NEVER
    assert piece in story.text and stop not in story.text  # precondition
    run = generate(loaded, story.prompt, greedy(max_tokens=REF_TOKENS, stop=(stop,)), batched=batched)
    assert run.final.finish_reason is FinishReason.LENGTH
    if same_tokens_or_near_tie(loaded, story.prompt, story.ids, run.ids):
        assert run.text == story.text
    else:
        assert run.text == loaded.tokenizer.decode(run.ids)
    assert held_at_some_step(run, loaded.tokenizer), "the stop prefix was never held back"


@pytest.mark.parametrize("batched", [False, True], ids=["B1", "batched"])
def test_s2_prefix_held_when_eos_ends(loaded, chat_eos, batched):
    """S2: the reply ends by EOS while the stop string's prefix (the reply's last characters) is
    held back: the held text comes out once, on the final output."""
    prefix = chat_eos.text[-2:]
    stop = prefix + NEVER
    assert chat_eos.text.endswith(prefix) and stop not in chat_eos.text  # precondition
    assert held_after(chat_eos.texts, stop) == prefix  # precondition: held when EOS comes
    run = generate(loaded, chat_eos.prompt, greedy(max_tokens=40, stop=(stop,)), batched=batched)
    assert run.final.finish_reason is FinishReason.STOP
    assert run.final.token_ids[0] in loaded.tokenizer.eog_ids
    assert same_tokens_or_near_tie(loaded, chat_eos.prompt, chat_eos.ids, run.ids)
    assert run.text == chat_eos.text
    assert run.final.text.endswith(prefix)  # released at the end, not before
    assert "".join(o.text for o in run.outs[:-1]) == chat_eos.text[:-len(prefix)]


@pytest.mark.parametrize("batched", [False, True], ids=["B1", "batched"])
def test_s2_prefix_held_when_max_tokens_ends(loaded, story, batched):
    """S2: max_tokens ends the sequence on a token whose text ends with the stop string's prefix:
    the held text is released once, on the final output (finish_reason length)."""
    k = 12
    while len(story.texts[k - 1]) < 2:
        k += 1
    prefix = story.texts[k - 1][-2:]
    stop = prefix + NEVER
    cut = "".join(story.texts[:k])
    assert cut.endswith(prefix) and stop not in story.text  # precondition
    held = held_after(story.texts[:k], stop)
    assert held.endswith(prefix)  # precondition: a partial match is held when max_tokens hits
    run = generate(loaded, story.prompt, greedy(max_tokens=k, stop=(stop,)), batched=batched)
    assert run.final.finish_reason is FinishReason.LENGTH and run.final.num_output_tokens == k
    assert same_tokens_or_near_tie(loaded, story.prompt, story.ids, run.ids)
    assert run.text == cut
    # the last step emits what was held before it plus its own token's text, the held part included
    before = held_after(story.texts[:k - 1], stop)
    assert run.final.text == before + story.texts[k - 1] and run.final.text.endswith(held)
    assert "".join(o.text for o in run.outs[:-1]) + run.final.text == cut


# -- T1: multibyte characters split across tokens, end to end ---------------------------------

#: Chat prompts whose greedy replies contain characters split over several byte tokens (the
#: precondition is asserted): a 4-byte emoji (3 tokens), CJK (3 single-byte tokens), kana + kanji.
T1_CASES = {
    "emoji": ("Write three emojis.", 18),           # ends on a whole emoji
    "emoji_cut": ("Write three emojis.", 19),       # max_tokens cuts an emoji: flushed as U+FFFD
    "cjk_eos": ("How do you say hello in Chinese?", 40),  # ends by EOS
    "kana": ("Translate 'thank you' into Japanese.", 20),
}


def complete_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters, decoded."""
    for n in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:n].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise AssertionError("invalid UTF-8 in the middle")


def t1_request(loaded, case: str) -> Request:
    message, max_tokens = T1_CASES[case]
    return Request(case, loaded.tokenizer.encode_chat([{"role": "user", "content": message}]),
                   greedy(max_tokens=max_tokens))


@pytest.fixture(scope="module")
def t1_batched(loaded) -> dict[str, Run]:
    """Every T1 case in one batch, streamed, beside a seeded sampled neighbour."""
    reqs = [t1_request(loaded, c) for c in T1_CASES] + neighbours(loaded)[1:]
    return drive(new_scheduler(loaded), reqs)


@pytest.mark.parametrize("batched", [False, True], ids=["B1", "batched"])
@pytest.mark.parametrize("case", list(T1_CASES))
def test_t1_multibyte_split_across_tokens(loaded, case, batched, request):
    """T1: replies with emoji / CJK / kana whose bytes are split across tokens: the joined deltas
    equal decoding all generated ids at once; no delta holds half a character or U+FFFD (except
    the final flush of bytes really left incomplete by max_tokens); B=1 and batched (all cases
    in one batch with a sampled neighbour)."""
    tok = loaded.tokenizer
    if batched:
        run = request.getfixturevalue("t1_batched")[case]
    else:
        run = drive(new_scheduler(loaded), [t1_request(loaded, case)])[case]
    ids = [i for i in run.ids if i not in tok.eog_ids]
    data = [tok.token_bytes(i) for i in ids]
    # precondition: some character's bytes are split across tokens
    split = [i for i, b in enumerate(data) if complete_prefix(b"".join(data[:i + 1])) == complete_prefix(
        b"".join(data[:i])) and b]
    assert split, f"{case}: no multibyte character split across tokens in {tok.decode(ids)!r}"
    assert any(len(ch.encode()) > 1 for ch in tok.decode(ids))
    assert run.text == tok.decode(run.ids)
    # each step emits exactly the whole characters completed so far: never half of one
    emitted = ""
    for n, o in enumerate(run.outs[:-1], 1):
        emitted += o.text
        assert FFFD not in o.text
        assert emitted == complete_prefix(b"".join(tok.token_bytes(i) for i in run.ids[:n]
                                                   if not tok.is_special(i)))
    assert sum(1 for o in run.outs if o.text) < len(run.outs)
    all_bytes = b"".join(data)
    whole = complete_prefix(all_bytes) == all_bytes.decode("utf-8", "replace")
    if case == "emoji_cut":  # precondition: max_tokens really cut a character
        assert run.final.finish_reason is FinishReason.LENGTH and not whole
    if case == "emoji":
        assert whole
    if whole:
        assert FFFD not in run.text and all_bytes.decode("utf-8") == run.text
    else:  # the incomplete bytes are flushed once, as one U+FFFD, on the final output
        assert run.text.count(FFFD) == 1 and run.final.text.endswith(FFFD) and run.text.endswith(FFFD)
    if case == "cjk_eos":
        assert run.final.finish_reason is FinishReason.STOP


# -- P1: which tokens each penalty counts -------------------------------------------------------

#: One word repeated (the first occurrence has no leading space, so the prompt has 2 distinct ids).
#: Six times: the bundled model's greedy continuation keeps repeating it (asserted); at 10+ it
#: stops repeating, which would leave the repetition penalty nothing to change end to end.
P1_PROMPT = "hello" + " hello" * 5


@pytest.fixture(scope="module")
def p1(loaded):
    ids = loaded.tokenizer.encode(P1_PROMPT)
    assert len(set(ids)) <= 3 and len(ids) >= 6
    return ids, first_logits(loaded, ids)


def transform(loaded, prompt, logits, generated=(), **kw) -> torch.Tensor:
    state = SamplerState(SamplingParams(temperature=0.0, **kw), prompt, seed=0)
    for t in generated:
        state.accept(t)
    return RowSampler(loaded.model.args.vocab_size).transform(logits, [state])[0]


def changed(a: torch.Tensor, b: torch.Tensor) -> set[int]:
    return set(torch.nonzero(a != b).flatten().tolist())


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                                     dict(presence_penalty=-2.0, frequency_penalty=1.5)],
                         ids=["presence", "frequency", "both"])
def test_p1_presence_frequency_ignore_the_prompt(loaded, p1, penalty):
    """P1: presence/frequency penalties count generated tokens only: on the first step the
    logits of a one-word-repeated prompt are unchanged; once that word is generated they move."""
    prompt, logits = p1
    plain = transform(loaded, prompt, logits)
    assert torch.equal(transform(loaded, prompt, logits, **penalty), plain)
    word = prompt[-1]
    after = transform(loaded, prompt, logits, generated=[word], **penalty)
    assert changed(after, plain) == {word}


def test_p1_repeat_penalty_counts_the_prompt_within_its_window(loaded, p1):
    """P1: the repetition penalty counts prompt + output within repeat_last_n: it changes the
    first-step logits of exactly the window's prompt tokens; 0 disables it; -1 covers the whole
    context (the first, unspaced "hello" lies outside a window of 3)."""
    prompt, logits = p1
    plain = transform(loaded, prompt, logits)
    first, word = prompt[0], prompt[-1]
    assert first not in prompt[-3:] and word in prompt[-3:]  # precondition
    assert changed(transform(loaded, prompt, logits, repeat_penalty=1.3), plain) == set(prompt[-64:])
    assert changed(transform(loaded, prompt, logits, repeat_penalty=1.3, repeat_last_n=3), plain) == {word}
    assert changed(transform(loaded, prompt, logits, repeat_penalty=1.3, repeat_last_n=-1), plain) == set(prompt)
    assert torch.equal(transform(loaded, prompt, logits, repeat_penalty=1.3, repeat_last_n=0), plain)
    # the penalty's effect: a positive logit is divided, a negative one multiplied
    pen = transform(loaded, prompt, logits, repeat_penalty=1.3, repeat_last_n=-1)
    for t in set(prompt):
        x = float(logits[0, t])
        assert float(pen[t]) == pytest.approx(x / 1.3 if x > 0 else x * 1.3, rel=1e-5)


def test_p1_end_to_end(loaded, p1):
    """P1 end to end: presence/frequency leave the first generated token alone; greedy with
    repeat_penalty=1.3 leaves the repetition the unpenalised continuation falls into."""
    prompt, logits = p1
    word = prompt[-1]
    plain = generate(loaded, prompt, greedy(max_tokens=8))
    assert plain.ids.count(word) >= 4  # precondition: unpenalised, it repeats the word
    assert plain.ids[0] == int(logits[0].argmax())
    pf = generate(loaded, prompt, greedy(max_tokens=1, presence_penalty=2.0, frequency_penalty=2.0))
    assert pf.ids == plain.ids[:1]
    rep = generate(loaded, prompt, greedy(max_tokens=8, repeat_penalty=1.3))
    assert rep.ids != plain.ids
    assert rep.ids.count(word) < plain.ids.count(word)


# -- loop detection -----------------------------------------------------------------------------

LOOP_PROMPT = "A B C" + " A B C" * 5


@pytest.fixture(scope="module")
def looping(loaded):
    prompt = loaded.tokenizer.encode(LOOP_PROMPT)
    run = generate(loaded, prompt, greedy(max_tokens=32, loop_window=0))
    assert run.final.finish_reason is FinishReason.LENGTH and len(run.ids) == 32
    # precondition: the unwatched output loops, and the rule sees it well before the cap
    first = next(n for n in range(1, 33) if FinishStep.is_looping(run.ids[:n], 8))
    assert first < 24
    return prompt, run, first


def test_loop_window_stops_a_looping_sequence(loaded, looping):
    """loop_window=8 ends a greedy loop with finish_reason loop at the first token where the tail
    repeats, before max_tokens; the tokens up to there are the unwatched run's."""
    prompt, ref, first = looping
    run = generate(loaded, prompt, greedy(max_tokens=32, loop_window=8))
    assert run.final.finish_reason is FinishReason.LOOP
    assert len(run.ids) == first < 32
    assert run.ids == ref.ids[:first]
    assert run.text == loaded.tokenizer.decode(run.ids)


def test_loop_window_zero_runs_to_max_tokens(loaded, looping):
    """loop_window=0 (off) lets the loop run to max_tokens (finish_reason length); the fixture's
    run is that request, so this checks what it produced."""
    prompt, run, first = looping
    assert run.final.finish_reason is FinishReason.LENGTH and len(run.ids) == 32 > first
    assert FinishStep.is_looping(run.ids, 8)


@pytest.mark.parametrize("period", [1, 3, 32])
def test_is_looping_detects_periods_up_to_the_max(period):
    pattern = list(range(100, 100 + period))
    tokens = [1, 2] + (pattern * (8 // period + 3))
    assert FinishStep.is_looping(tokens, 8)
    # the boundary: the periodic tail must be window + period tokens long
    tail = (pattern * 10)[: 8 + period]
    assert FinishStep.is_looping([7] + tail, 8)
    assert not FinishStep.is_looping([7] + tail[1:], 8)
    assert not FinishStep.is_looping(tail[1:], 8)
    assert not FinishStep.is_looping(tokens, 0)


def test_is_looping_ignores_longer_periods_and_no_repeat():
    pattern = list(range(LOOP_MAX_PERIOD + 1))  # period 33
    assert not FinishStep.is_looping(pattern * 3, 8)
    assert FinishStep.is_looping(pattern * 3, 8, max_period=LOOP_MAX_PERIOD + 1)
    assert not FinishStep.is_looping(list(range(200)), 8)
    assert not FinishStep.is_looping([], 8)
    assert not FinishStep.is_looping([5] * 8, 8)  # 8 tokens: no earlier window to compare with
    assert FinishStep.is_looping([5] * 9, 8)
    # a window of 1 only needs the last token repeated one period back
    assert FinishStep.is_looping([1, 2, 1], 1) and not FinishStep.is_looping([1, 2, 3], 1)


# -- min_tokens / ignore_eos / stop_token_ids ---------------------------------------------------

def test_min_tokens_outlasts_eos(loaded, chat_eos):
    """min_tokens=k+5 on a reply that ends by EOS after k tokens: at least k+5 tokens, no
    end-of-generation id among the first k+5."""
    k = len(chat_eos.ids) - 1
    run = generate(loaded, chat_eos.prompt, greedy(max_tokens=k + 12, min_tokens=k + 5))
    assert len(run.ids) >= k + 5
    assert not set(run.ids[:k + 5]) & loaded.tokenizer.eog_ids
    assert run.ids[:k] == chat_eos.ids[:k]


def test_ignore_eos_runs_to_max_tokens(loaded, chat_eos):
    """ignore_eos with max_tokens=k+5: exactly k+5 tokens, finish_reason length."""
    k = len(chat_eos.ids) - 1
    run = generate(loaded, chat_eos.prompt, greedy(max_tokens=k + 5, ignore_eos=True))
    assert len(run.ids) == k + 5 and run.final.num_output_tokens == k + 5
    assert run.final.finish_reason is FinishReason.LENGTH
    assert not set(run.ids) & loaded.tokenizer.eog_ids


@pytest.mark.parametrize("batched", [False, True], ids=["B1", "batched"])
def test_stop_token_id_ends_at_first_occurrence(loaded, chat_eos, batched):
    """stop_token_ids=[the reference's 3rd token]: ends at its first occurrence with stop, and
    that token adds no text."""
    stop_id = chat_eos.ids[2]
    j = chat_eos.ids.index(stop_id)
    run = generate(loaded, chat_eos.prompt, greedy(max_tokens=40, stop_token_ids=(stop_id,)), batched=batched)
    assert run.final.finish_reason is FinishReason.STOP
    assert run.ids == chat_eos.ids[:j + 1]
    assert run.final.text == ""
    assert run.text == loaded.tokenizer.decode(chat_eos.ids[:j])


def test_ban_early_stops_masks_each_row_as_a_row_alone():
    """The grouped mask (one launch per distinct banned set: every row, a run, or scattered rows)
    equals masking each row by itself, for a mix of ignore_eos, min_tokens with stop ids, rows
    already past min_tokens and grammar rows (left alone)."""
    from types import SimpleNamespace

    eog = frozenset({0, 2})
    finisher = FinishStep(eog, 4096)

    def seq(ignore_eos=False, min_tokens=0, stop_ids=(), made=0, grammar=None):
        params = SamplingParams(ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=list(stop_ids))
        return SimpleNamespace(params=params, output_ids=[5] * made, sampler=SimpleNamespace(grammar=grammar))

    cases = [
        [seq(ignore_eos=True) for _ in range(4)],  # every row: one index_fill_
        [seq(), seq(ignore_eos=True), seq(ignore_eos=True), seq()],  # a run of rows
        [seq(ignore_eos=True), seq(), seq(min_tokens=3, stop_ids=[7, 9]), seq(ignore_eos=True),
         seq(min_tokens=3, stop_ids=[7, 9], made=3), seq(ignore_eos=True, grammar=object()),
         seq(min_tokens=8, stop_ids=[7, 9], made=2)],  # scattered rows, two sets, a grammar row
        [seq(), seq()],  # nothing banned: the logits themselves
    ]
    for seqs in cases:
        logits = torch.randn(len(seqs), 16)
        for ahead in (0, 1):
            got = finisher.ban_early_stops(logits, seqs, ahead)
            want = logits.clone()
            for r, s in enumerate(seqs):
                p = s.params
                early = len(s.output_ids) + ahead < p.min_tokens
                if s.sampler.grammar is None and (p.ignore_eos or early):
                    want[r, sorted(eog | (set(p.stop_token_ids) if early else set()))] = float("-inf")
            assert torch.equal(got, want)
            assert (got is logits) == torch.equal(want, logits)


def test_row_output_fields_keep_the_order_the_finish_step_passes_them_in():
    """FinishStep.apply builds RowOutput positionally (half the keyword call's cost, a row a
    step): its first eight fields must stay in this order."""
    from dataclasses import fields

    from monobatch.engine.finish import RowOutput

    assert [f.name for f in fields(RowOutput)][:8] == [
        "request_id", "token_ids", "text", "finish_reason", "logprobs", "num_prompt_tokens", "num_output_tokens",
        "num_cached_tokens"]
