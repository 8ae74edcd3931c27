"""``monobatch parity``'s comparison (the first divergent token and the margin there) and its
report types: :class:`DoorResult` per door, :class:`ConfigReport` per sampling config,
:class:`ParityReport` for the run (text, JSON, exit code)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


# -- comparing ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Divergence:
    """Where a door's tokens first differ from the reference's.

    Attributes:
        index: position in the generated tokens (0 = the first generated token).
        reference_token / door_token: the ids there (None where that side has no token: it
            ended sooner).
        margin: the reference's draw margin at that token (``Engine.draw_margin``: a greedy
            draw's top-2 logit gap, a seeded draw's gap between its two best noise-perturbed
            scores; >= 0, ``inf`` where one token alone could be drawn; None when not computed):
            small means a near-tie, where fast-mode numerics may flip the draw.
    """

    index: int
    reference_token: int | None
    door_token: int | None
    margin: float | None = None


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """Index of the first position where ``other`` differs from ``reference``.

    Returns:
        The index; the shorter length when one is a strict prefix of the other; None when the
        lists are equal.
    """
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def compare(prompt_ids: list[int], reference: list[int], other: list[int],
            margin_of: Callable[[list[int]], float] | None = None) -> Divergence | None:
    """Compare a door's generated ids with the reference's.

    Args:
        prompt_ids: the prompt both generated from (token ids).
        reference / other: generated token ids (prompt excluded).
        margin_of: maps a token-id context to the draw margin after it (e.g.
            ``Engine.draw_margin`` of the request's params); called once, with
            ``prompt_ids + reference[:index]``.

    Returns:
        None when identical, else the first :class:`Divergence`.
    """
    i = first_divergence(reference, other)
    if i is None:
        return None
    margin = margin_of(list(prompt_ids) + list(reference[:i])) if margin_of is not None else None
    return Divergence(i, reference[i] if i < len(reference) else None, other[i] if i < len(other) else None, margin)


# -- results -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class DoorResult:
    """One door's run for one config.

    Attributes:
        door: one of :data:`DOORS`.
        status: ``reference`` (the generate door), ``identical``, ``diverged`` or ``error``.
        token_ids: the generated ids the engine produced for this door's request.
        divergence: where they first differ from the reference (``diverged`` only).
        paged_attention_calls: the door's engine's paged-attention calls during the door (one per
            layer per step; includes the batch door's neighbours; 0 on dense storage).
        cached_tokens: prompt tokens adopted from the prefix cache.
        prefill_chunks: ``(start, end)`` prompt positions computed, chunk by chunk.
        shared_steps / num_steps / max_batch_seqs: steps the request shared with other sequences,
            its steps in all (prefill chunks + decodes), the most sequences in one of them.
        evidence: what the door proved, for the report (``CLI text == decode(ids)``, ...).
        problems: checks that failed (the door ran, but did not show what it must).
        error: why the door could not run (``error`` status).
        seconds: wall time of the door.
    """

    door: str
    status: str = "error"
    token_ids: list[int] = field(default_factory=list)
    divergence: Divergence | None = None
    paged_attention_calls: int | None = None
    cached_tokens: int | None = None
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    shared_steps: int | None = None
    num_steps: int | None = None
    max_batch_seqs: int | None = None
    evidence: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Identical to the reference (or the reference itself) with every check passed."""
        return self.status in ("reference", "identical") and not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        out = dataclasses.asdict(self)
        out["prefill_chunks"] = [list(c) for c in self.prefill_chunks]
        out["ok"] = self.ok
        return out


@dataclass(slots=True)
class ConfigReport:
    """The doors of one sampling config.

    Attributes:
        name: ``greedy`` or ``seeded``.
        fields: the request fields every door sent (max_tokens and ignore_eos included).
        prompt_ids: the reference's prompt ids (chat template applied).
        doors: :class:`DoorResult` per door, the reference first.
    """

    name: str
    fields: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    doors: list[DoorResult] = field(default_factory=list)


@dataclass(slots=True)
class ParityReport:
    """The whole report.

    Attributes:
        mode: ``deterministic`` or ``fast``.
        device: e.g. ``cpu`` or ``cuda:0 (NVIDIA H200)``; dtype: the compute dtype.
        model: the model's name; prompt: the user message; max_tokens: tokens per door.
        configs: one :class:`ConfigReport` per config.
        seconds: wall time after loading.
    """

    mode: str
    device: str
    dtype: str
    model: str
    prompt: str
    max_tokens: int
    batch_prefill_chunk: int
    configs: list[ConfigReport] = field(default_factory=list)
    seconds: float = 0.0

    def results(self) -> list[DoorResult]:
        """Every door result of every config."""
        return [d for c in self.configs for d in c.doors]

    @property
    def errors(self) -> int:
        """Doors that failed to run."""
        return sum(d.status == "error" for d in self.results())

    @property
    def identical(self) -> bool:
        """Every door identical to its reference with every check passed (and no errors)."""
        return all(d.ok for d in self.results())

    def exit_code(self, expect_identical: bool) -> int:
        """2 when a door failed to run; else 1 when ``expect_identical`` and something differs
        or a check failed; else 0."""
        if self.errors:
            return 2
        return 1 if expect_identical and not self.identical else 0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {"mode": self.mode, "device": self.device, "dtype": self.dtype, "model": self.model,
                "prompt": self.prompt, "max_tokens": self.max_tokens, "batch_prefill_chunk": self.batch_prefill_chunk,
                "identical": self.identical, "errors": self.errors, "seconds": round(self.seconds, 2),
                "configs": [{"name": c.name, "fields": c.fields, "prompt_ids": c.prompt_ids,
                             "doors": [d.to_dict() for d in c.doors]} for c in self.configs]}

    def text(self) -> str:
        """The human-readable report."""
        mode = "deterministic (--deterministic)" if self.mode == "deterministic" else "fast (the default)"
        lines = [f"monobatch parity: mode {mode}, device {self.device} ({self.dtype}), model {self.model}",
                 f"prompt: {self.prompt!r}"]
        for c in self.configs:
            fields = ", ".join(f"{k}={v}" for k, v in c.fields.items())
            lines += ["", f"[{c.name}] {len(c.prompt_ids)} prompt tokens (chat template); {fields}",
                      f"  {'door':<15} {'result':<15} {'paged-attn':>10}  {'prefill: cached + computed':<36} evidence"]
            for d in c.doors:
                if d.status == "diverged" and d.divergence is not None:
                    result = f"diverged@{d.divergence.index}"
                else:
                    result = d.status
                calls = "-" if d.paged_attention_calls is None else str(d.paged_attention_calls)
                prefill = "-" if d.cached_tokens is None else \
                    f"{d.cached_tokens} + " + " ".join(f"[{s},{e})" for s, e in d.prefill_chunks)
                lines.append(f"  {d.door:<15} {result:<15} {calls:>10}  {prefill:<36} {'; '.join(d.evidence)}")
                if d.divergence is not None:
                    v = d.divergence
                    margin = "-" if v.margin is None else f"{v.margin:.4f}"
                    lines.append(f"      first divergence at generated token {v.index}: reference {v.reference_token} "
                                 f"vs {v.door_token}; draw margin there {margin}")
                for p in d.problems:
                    lines.append(f"      CHECK FAILED: {p}")
                if d.error:
                    lines.append(f"      ERROR: {d.error}")
        n = len(self.results())
        good = sum(d.ok for d in self.results())
        lines += ["", f"result: {good} of {n} door runs identical to the reference with every check passed"
                      + (f"; {self.errors} failed to run" if self.errors else "")
                      + f" ({self.seconds:.1f} s)"]
        return "\n".join(lines)


def write_json(report: ParityReport, path: str) -> None:
    """Write ``report.to_dict()`` to ``path`` (``-``: stdout)."""
    text = json.dumps(report.to_dict(), indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")
