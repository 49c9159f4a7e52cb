"""Training computes what serving runs: the unrolled draft of net.py equals the engine's chain.

The engine (strata/mtp/draft.py DraftModel, numpy, CPU backend) catches the draft up on the
target's true hiddens and then chains steps on its own outputs (as DraftProposer does); the
training network (PyTorch) computes every position's chain at once (`DraftNet.unrolled`). With
the shipped draft's weights (Q8_0, dequantized for torch) and the real target's hiddens, the
draft outputs of positions 1, 2 and 3 must agree row by row. Needs PyTorch (skipped without).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from strata.mtp.defaults import default_draft_path  # noqa: E402
from strata.mtp.draft import DraftModel, find_draft  # noqa: E402
from strata.mtp.train.measure import chat_ids, load_core  # noqa: E402
from strata.mtp.train.net import DraftNet, Dims  # noqa: E402
from strata.mtp.train.prompts import HELD_OUT  # noqa: E402
from strata.mtp.train.weights import draft_weights  # noqa: E402
from strata.model.transformer import Span  # noqa: E402


def test_unrolled_training_passes_equal_the_engines_chained_draft():
    path = str(default_draft_path())
    core = load_core(None, None, 0)
    m, cfg = core.model, core.cfg
    toks = chat_ids(core, HELD_OUT["code"][0]) + core.tokenizer.encode("def f(xs):\n    return sum(x * x for x in xs)")
    toks = np.asarray(toks, np.int64)
    hid = np.asarray(core.backend.to_host(m.forward(toks, [Span(m.new_cache(len(toks), "f16"), 0, len(toks))])), np.float32)

    dims = Dims(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_base, cfg.rope_dim, cfg.rope_scale,
                cfg.traits.rope_neox, cfg.rms_eps)
    embed = np.asarray(core.backend.to_host(m.embd), np.float32)
    net = DraftNet(dims, draft_weights(path), embed, embed)
    with torch.no_grad():
        outs = [o[0].numpy() for o in net.unrolled(torch.from_numpy(toks)[None], torch.from_numpy(hid[:-1])[None], 3)]

    d = DraftModel(core.backend, cfg, find_draft(path, core.pack), m)
    n = len(toks)
    checked = 0
    for r in (3, n // 2, n - 4):  # catch-up ends at entry index r (token x_{r+1}), then 2 chained steps
        cache = d.new_cache(n + 4, "f16")  # f16 keys/values: errors measured ~3e-5
        g, _ = d.step(cache, toks[1 : r + 2], hid[: r + 1])
        chain = [np.asarray(g[-1])]
        for j in (1, 2):
            g, _ = d.step_last([(cache, toks[r + 1 + j : r + 2 + j], g[-1:])])
            chain.append(np.asarray(g[0]))
        for j, row in enumerate(chain):
            want = outs[j][r]
            err = np.abs(row - want).max() / np.abs(want).max()
            assert err < 1e-3, f"position {j + 1}, catch-up to index {r}: relative error {err:.1e}"
            cos = float(row @ want / np.linalg.norm(row) / np.linalg.norm(want))
            assert cos > 0.99999, f"position {j + 1}, catch-up to index {r}: cosine {cos:.5f}"
            checked += 1
    assert checked == 9
