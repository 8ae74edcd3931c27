"""``monobatch parity``: one prompt and sampling config through every door, compared token id by
token id with the engine run directly at B=1 (the one-engine invariants of docs/adr/0001 and
/work/shared/design/ENGINE.md, checked end to end).

Usage::

    monobatch parity                                  # fast mode, both configs, a text report
    monobatch parity --deterministic --expect-identical -t 1    # exit 1 on any divergence
    monobatch parity --configs greedy -n 64 --prompt "Why is the sky blue?" --json report.json
    monobatch parity --device cuda --deterministic    # any model and engine flag of generate

The doors, each generating from the same chat prompt (one user message through the model's chat
template) with the same sampling fields, ``max_tokens`` and ``ignore_eos``:

==============  ==========================================================================
``generate``    the reference: a fresh :class:`BatchScheduler` in this process, B=1, with the
                ``--kv-storage`` / ``--prefill-chunk`` flags (the engine directly, no HTTP)
``run``         ``python -m monobatch run --server-base URL`` (a subprocess: the chat CLI over
                HTTP/SSE) against an in-process server built from the same flags; the text it
                prints must equal the detokenized ids the engine generated
``server-dense`` ``POST /v1/chat/completions`` on a fresh server with dense KV storage, B=1
``server-paged`` the same on a fresh paged server (a prefix-cache miss)
``prefix-hit``  the same request again on that paged server: it must adopt cached blocks
``batch``       the request inside 8 concurrent others (other prompts, lengths and sampling:
                penalties, biases, other seeds; 4 already decoding when it arrives) on a fresh
                paged server whose prefill chunk is ``--batch-prefill-chunk`` (16 by default, so
                its prompt is computed in several chunks beside the others' decodes); it
                bypasses the prefix cache (``cache_prompt: false``) so that only batching and
                chunking differ from the reference
==============  ==========================================================================

The server doors read what the engine generated (ids, prefix-cache adoption, prefill chunks,
how many sequences shared its steps) through a finish observer on the server's scheduler
(:meth:`BatchScheduler.add_finish_observer`), cross-checked against the HTTP answer's
``token_ids``; paged-attention calls come from ``/metrics``
(``monobatch_paged_attention_calls_total``; dense storage: 0).

For each door the report says ``identical``, or the first divergent index, both token ids and
the reference's draw margin there (``Engine.draw_margin``: how near that draw was to another
token — for a greedy config the top-2 logit gap, for a seeded one the gap between the two best
noise-perturbed scores of the draw, which is what flips a seeded token; the raw logits' top-2
says nothing there). Under ``--deterministic`` every door must be identical; in the default (fast)
mode a divergence is expected only at a near-tie.

The package: :mod:`.report` (the comparison and the report types), :mod:`.serving` (an
in-process server with a finish recorder, and the ``run`` subprocess), :mod:`.doors` (the doors
and :func:`run_parity`).

Exit codes: 0 = done (every door identical, or differences without ``--expect-identical``);
1 = with ``--expect-identical``, a door diverged or a check failed (no prefix hit, no shared
steps, no paged attention on a paged door, CLI text != decode(ids), ...); 2 = an error: a bad
flag, a model that cannot load, a door that failed to run.
"""
from monobatch.parity.doors import CONFIGS, DEFAULT_PROMPT, DOORS, PAGED_DOORS, run_parity, sampling_fields
from monobatch.parity.report import (ConfigReport, Divergence, DoorResult, ParityReport, compare, first_divergence,
                                     write_json)
from monobatch.parity.serving import run_cli_door

__all__ = ["CONFIGS", "DEFAULT_PROMPT", "DOORS", "PAGED_DOORS", "ConfigReport", "Divergence", "DoorResult",
           "ParityReport", "compare", "first_divergence", "run_cli_door", "run_parity", "sampling_fields",
           "write_json"]
