"""Stop strings matched on streamed text across token boundaries (cases S1, S2).

Text that could still turn into a stop string is held back; it is released once the match
fails, and dropped (or kept, with ``include_stop_str_in_output``) when it completes.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back text safe to emit and whether a stop string completed.

    Invariant: the held text is the longest suffix of everything fed that is a proper prefix
    of some stop string, so a stop string can never begin inside text already emitted.

    Args:
        stops: the stop strings (non-empty).
        include_stop: emit the stop string itself when it matches (vLLM's
            ``include_stop_str_in_output``).
    """

    def __init__(self, stops: tuple[str, ...] | list[str], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self.held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text now safe to emit. After a match, returns "" forever."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return delta
        buf = self.held + delta
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            idx, stop = min(hits)
            self.matched, self.held = stop, ""
            return buf[: idx + len(stop)] if self.include_stop else buf[:idx]
        keep = next((p for p in range(max(0, len(buf) - max(map(len, self.stops)) + 1), len(buf))
                     if any(s.startswith(buf[p:]) for s in self.stops)), len(buf))
        self.held = buf[keep:]
        return buf[:keep]

    def flush(self) -> str:
        """The sequence ended without the held text completing a stop string: release it once."""
        out, self.held = ("" if self.matched is not None else self.held), ""
        return out
