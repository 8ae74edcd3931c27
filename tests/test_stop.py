"""StopMatcher unit tests (cases S1, S2 at the text level; engine-level tests use the model)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from monobatch.engine.stop import StopMatcher


def feed_all(m: StopMatcher, pieces: list[str]) -> str:
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush()


def test_stop_across_pieces_is_cut():
    m = StopMatcher(["END"])
    assert feed_all(m, ["abc E", "N", "D tail"]) == "abc "
    assert m.matched == "END"


def test_include_stop_keeps_it():
    m = StopMatcher(["END"], include_stop=True)
    assert feed_all(m, ["abc E", "ND more"]) == "abc END"


def test_held_prefix_released_once_when_match_fails():
    m = StopMatcher(["ENDING"])
    emitted = [m.feed("xx EN"), m.feed("D"), m.feed("ed")]
    assert emitted[0] == "xx " and emitted[1] == ""
    assert "".join(emitted) + m.flush() == "xx ENDed"


def test_held_prefix_released_at_the_end():
    m = StopMatcher(["ENDING"])
    assert m.feed("tail EN") == "tail "
    assert m.flush() == "EN"
    assert m.flush() == ""


def test_earliest_stop_wins():
    m = StopMatcher(["bc", "a"])
    assert feed_all(m, ["xabc"]) == "x"


@given(st.text(alphabet="abEND ", max_size=40), st.lists(st.integers(1, 5), max_size=20),
       st.sampled_from(["END", "ab", "b", "NDa"]))
def test_property_equals_cut_at_first_occurrence(text, cuts, stop):
    """Whatever the split into pieces, output = text up to the first stop occurrence."""
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i:i + c])
        i += c
    pieces.append(text[i:])
    m = StopMatcher([stop])
    idx = text.find(stop)
    assert feed_all(m, pieces) == (text if idx < 0 else text[:idx])
