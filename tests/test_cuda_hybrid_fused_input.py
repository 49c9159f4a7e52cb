"""A qwen3next pack with fused ssm_in DeltaNet inputs on the CUDA backend: its rows reach the
device through the same linear_weight path as attn_qkv + attn_gate (tests/test_hybrid_fused_input.py
has the CPU side and the independent split), so its logits equal the split pack's exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tests.support.gpu import require_cuda, require_synth_tokenizer

cp = require_cuda()

from strata.backend.cuda import CudaBackend  # noqa: E402
from strata.model.build import build_model  # noqa: E402
from strata.model.transformer import Span  # noqa: E402
from strata.pack.loader import open_pack  # noqa: E402
from strata.pack.presets import TINY  # noqa: E402
from strata.pack.synth import synth_pack  # noqa: E402
from strata.pack.synth_plan import with_delta_net_input  # noqa: E402
from tests.test_hybrid_fused_input import IDS, split_copy  # noqa: E402


def _logits(path, backend):
    pack = open_pack(pack=str(path))
    model = build_model(backend, pack.model_config(), lambda n: pack.tensors.get(n))
    assert len({layer.mixer.input_form for layer in model.recurrent_layers}) == 1
    cache = model.new_cache(64, "f16")
    _, logits = model.forward(np.asarray(IDS), [Span(cache, 0, len(IDS))], logit_rows=list(range(len(IDS))))
    return np.asarray(backend.to_host(logits))


def test_fused_and_split_packs_give_the_same_logits_on_cuda(tmp_path):
    require_synth_tokenizer()
    spec = with_delta_net_input(replace(TINY["qwen3next"], vocab=4096), "fused")
    (fused,) = synth_pack(spec, tmp_path / "fused", progress=lambda *a: None)
    split = split_copy(fused, tmp_path / "split" / "model.gguf")
    b = CudaBackend()
    np.testing.assert_array_equal(_logits(fused, b), _logits(split, b))
