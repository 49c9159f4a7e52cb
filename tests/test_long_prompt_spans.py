"""The scheduler marks long prompts' spans (Span.long_prompt) from the request alone.

A backend with a prompt path (CUDA: dequant + GEMM) multiplies those rows differently, so
the mark must follow the prompt's length only: never a window's width, the chunking of the
prefill budget, or decode rows sharing the window. Run on the CPU backend (which ignores the
mark) with the threshold set on it, recording the spans of every window.
"""

from __future__ import annotations

import numpy as np

from strata.model.transformer import Span
from tests.support.engines import greedy, load_engine, run_all
from tests.support.gpu import require_synth_tokenizer
from tests.support.model_fixtures import synth_model


def test_only_long_prompts_prefill_spans_are_marked(tmp_path):
    require_synth_tokenizer()
    core, _ = load_engine(["--pack", str(synth_model(tmp_path, "llama")), "--device", "cpu", "--parallel", "3",
                           "--prefill", "40"])
    core.model.b.long_prompt_tokens = 50
    seen: list[list[Span]] = []
    forward = core.model.forward

    def recording(tokens, spans, *a, **kw):
        seen.append([Span(sp.cache, sp.start, sp.count, sp.long_prompt) for sp in spans])
        return forward(tokens, spans, *a, **kw)

    core.model.forward = recording
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 900, n).tolist() for n in (90, 20, 50)]  # long, short, just long
    outs = run_all(core, prompts, greedy(6), threaded=False)
    assert all(len(o[0]) == 6 for o in outs)
    caches = {id(s.cache): len(p) for s, p in zip(core.scheduler.slots, prompts)}
    marked = [(caches[id(sp.cache)], sp) for w in seen for sp in w if sp.long_prompt]
    assert marked, "no span was marked"
    for n, sp in marked:  # only prompts of >= 50 tokens, only their prompt positions
        assert n >= 50 and sp.start + sp.count <= n
    chunks = [sp.count for w in seen for sp in w if caches[id(sp.cache)] == 90 and sp.start < 90]
    assert sum(chunks) == 90 and len(chunks) > 1  # the 90-token prompt came in several chunks, all marked
    unmarked_long = [sp for w in seen for sp in w if caches[id(sp.cache)] >= 50 and sp.start < caches[id(sp.cache)]
                     and not sp.long_prompt]
    assert not unmarked_long
    # decode rows (past the prompt) and the short prompt are never marked
    assert all(not sp.long_prompt for w in seen for sp in w
               if caches[id(sp.cache)] < 50 or sp.start >= caches[id(sp.cache)])
