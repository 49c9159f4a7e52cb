"""Verification windows that also draft for the next window (--spec 1, greedy).

A window verifies [x_p, d] for a slot (rows at positions p and p + 1). Whatever the verdict,
the token at p + 1 is the target's argmax t_0 of row p (d when accepted), and when d is
accepted the token at p + 2 is the argmax t_1 of row p + 1. So the draft entries the next
proposal needs can be made in the same window, before the verdict is known: entry x_{p+1} :=
t_0 reading h_p, and x_{p+2} := t_1 reading h_{p+1}, each giving the draft's guess for the
token after it. After the verdict the host keeps the entries up to the new pending token and
that entry's guess is the next window's draft. One graph and one host wait per window instead
of a draft graph, its wait, then the verification graph and its wait.

    hidden, ids, draft_ids, draft_tops = forward_with_next_drafts(
        model, draft, tokens, spans, logit_rows, draft_rows, draft_spans)

The draft entries use the argmax on the device; only greedy windows take this path (the
scheduler decides, docs/BATCHING.md).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.model.transformer import advance, reserve


def forward_with_next_drafts(model: Any, draft: Any, tokens: np.ndarray, spans: Sequence[Any],
                             logit_rows: Sequence[int], draft_rows: Sequence[int],
                             draft_spans: Sequence[Any]) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """The main window (as Transformer.forward with logit_rows, greedy) plus one draft entry per
    row in `draft_rows` (window row indices, each also a logit row, ordered as `draft_spans`
    list them: each draft span covers its slot's rows). Entry for row q: token = the target's
    argmax of row q, hidden = the row's final hidden. Caches advance: every span's cache
    length becomes start + count (the main spans' and the draft spans').

    Returns the window's hidden states (device), the argmax of every logit row, and the
    draft's argmax and top probability for every draft row (host)."""
    b = model.b
    reserve(list(spans) + list(draft_spans))
    rows = np.asarray(logit_rows, np.int64)
    drows = np.asarray(draft_rows, np.int64)
    pick = np.searchsorted(rows, drows)  # each draft row's place among the logit rows
    if not (np.all(np.diff(rows) > 0) and np.array_equal(rows[pick], drows)):
        raise ValueError("draft rows must be logit rows, and logit rows ascending")
    inputs: dict[str, Any] = {"rows": rows, "pick": pick, "drows": drows, "dends": np.arange(len(drows))}

    def window(d):
        x = b.embed(model.embd, d["tokens"]) if "tokens" in d else d["x"]
        h = model.run_window(x, spans)
        ids = b.argmax_rows(model.logits(h[d["rows"]]))
        _, dids, dtop = draft.last_rows(ids[d["pick"]], h[d["drows"]], d["dends"], draft_spans, full=False)
        # the three small results in one float64 array (ids < 2^53 and float32 are exact): one
        # copy to the host instead of three
        xp = b.xp
        return h, xp.concatenate([ids.astype(xp.float64), dids.astype(xp.float64), dtop.astype(xp.float64)])

    graphs = b.graphs
    if graphs is not None and graphs.takes(spans) and graphs.takes(draft_spans):
        # a graph's input is the ids where the embedding is gathered on the device (the CUDA
        # embedding's blocks), else the rows embedded on the host
        if model.embd.blocks is not None:
            inputs["tokens"] = np.asarray(tokens, np.int64)
        else:
            inputs["x"] = b.embed_host(model.embd, tokens)
        # the small results go to the host at once: lent, not copied
        h, small = graphs.run_fn(("model+next-draft", id(model), id(draft)), window, inputs, spans,
                                 borrow=(False, True), more=[list(draft_spans)])
    else:
        inputs["tokens"] = np.asarray(tokens, np.int64)
        h, small = window({k: b.asarray(v) for k, v in inputs.items()})
    advance(list(spans) + list(draft_spans))
    small = np.asarray(b.to_host(small))
    n, m = len(rows), len(drows)
    return h, small[:n].astype(np.int64), small[n : n + m].astype(np.int64), small[n + m :].astype(np.float32)
