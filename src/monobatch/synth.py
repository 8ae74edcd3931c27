"""Synthesized English-like prompt text for the benchmarks, seeded: one word list and one
generator, used by ``monobatch bench`` (:func:`monobatch.bench.synth_prompt`, prompts of an exact
token count) and ``monobatch bench-serve`` (:func:`monobatch.bench_serve.synthesize_prompts`,
prompts of an approximate length for any server).

The sentences are random (determiner, adjective, noun, verb, preposition, conjunction), so two
prompts share no prefix a prefix cache could reuse beyond a word or two, and the text tokenizes
like prose (most words one token with a leading space).
"""

from __future__ import annotations

import random

_DET = ("the", "a", "every", "this", "that", "one", "our", "their", "some", "no")
_ADJ = ("quiet", "early", "small", "bright", "old", "careful", "distant", "green", "heavy", "simple", "narrow",
        "warm", "local", "final", "broken", "useful", "strange", "open", "patient", "silver", "common", "rapid")
_NOUN = ("river", "village", "teacher", "machine", "garden", "letter", "window", "engineer", "market", "storm",
         "library", "road", "farmer", "question", "bridge", "morning", "report", "kitchen", "island", "signal",
         "student", "harbor", "engine", "forest", "council", "painter", "museum", "valley", "record", "train")
_VERB = ("found", "carried", "watched", "built", "opened", "followed", "described", "repaired", "crossed",
         "measured", "remembered", "painted", "moved", "answered", "checked", "shared", "lifted", "studied")
_PREP = ("near", "behind", "across", "under", "beside", "after", "before", "through", "inside", "along")
_CONJ = ("When", "Because", "Although", "After", "Before", "While", "Since", "Until")


def _phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(_DET)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJ))
    return words + [rng.choice(_NOUN)]


def _clause(rng: random.Random) -> list[str]:
    words = _phrase(rng) + [rng.choice(_VERB)] + _phrase(rng)
    if rng.random() < 0.5:
        words += [rng.choice(_PREP)] + _phrase(rng)
    return words


def synth_words(rng: random.Random, num_sentences: int) -> list[str]:
    """``num_sentences`` plausible English sentences as words (punctuation attached)."""
    words: list[str] = []
    for _ in range(num_sentences):
        if rng.random() < 0.3:
            sentence = [rng.choice(_CONJ).lower()] + _clause(rng)
            sentence[-1] += ","
            sentence += _clause(rng)
        else:
            sentence = _clause(rng)
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        words += sentence
    return words


def synth_text(rng: random.Random, num_words: int) -> str:
    """Exactly ``num_words`` words of :func:`synth_words` sentences (the last one cut short)."""
    words: list[str] = []
    while len(words) < num_words:
        words += synth_words(rng, max(1, num_words // 8))
    return " ".join(words[:num_words])
