"""Embedding requests: the prompt is prefilled in chunks next to other requests, and the vector
is the mean of its final-normed hidden states, L2-normalised."""

from __future__ import annotations

import numpy as np

from strata.batch.scheduler import Scheduler, SchedulerConfig
from strata.protocol import GenerationRequest, SamplingParams
from strata.model.transformer import Span
from tests.support.model_fixtures import chat_ids, engine


def test_embedding_is_the_normalised_mean_hidden_and_leaves_neighbours_alone():
    core = engine(None, 4)
    text = "The quick brown fox jumps over the lazy dog. " * 3
    ids = core.tokenizer.encode(text)
    cache = core.model.new_cache(256, "f16")
    h = np.asarray(core.model.forward(np.asarray(ids), [Span(cache, 0, len(ids))]), dtype=np.float64)
    want = h.mean(axis=0)
    want /= np.linalg.norm(want)
    # prompt chunks of 8 tokens: the embedding is summed over several windows, beside a decode
    cfg = SchedulerConfig(parallel=2, max_ctx=512, kv_kind="f16", prefill_chunk=8)
    sch = Scheduler(core.model, core.tokenizer, cfg, log=lambda line: None)
    chat = chat_ids(core, "Hi")
    plain = sch.submit(GenerationRequest(chat, SamplingParams(max_tokens=8, temperature=0.0)))
    sch.run_until_idle()
    want_ids = plain.collect(10)[0]
    gen = sch.submit(GenerationRequest(chat, SamplingParams(max_tokens=8, temperature=0.0)))
    emb = sch.submit(GenerationRequest(ids, SamplingParams(max_tokens=1), embed=True))
    sch.run_until_idle()
    got_ids, text_out, fin = emb.collect(10)
    assert got_ids == [] and text_out == ""
    assert gen.collect(10)[0] == want_ids
    v = np.asarray(fin.embedding)
    assert fin.reason == "stop" and fin.prompt_tokens == len(ids) and fin.completion_tokens == 0
    assert abs(np.linalg.norm(v) - 1.0) < 1e-9
    assert float(v @ want) > 0.9999
    other = sch.submit(GenerationRequest(core.tokenizer.encode("Quarterly revenue grew by four percent."),
                                         SamplingParams(max_tokens=1), embed=True))
    sch.run_until_idle()
    assert float(np.asarray(other.collect(10)[2].embedding) @ v) < 0.99  # a different text, a different vector
