"""A draft carried inside the pack as nextn tensors (DeepSeek-V3 / GLM style) loads and runs.

The pack is the seed-moe preset with its MTP draft merged in as layer N = block_count:
`blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_norm}` plus the block's own tensors, and
`{arch}.nextn_predict_layers = 1` with block_count + 1, as llama.cpp's converters write it.
Without --mtp the engine must find it, keep it out of the main stack, and decode losslessly.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from tests.support.engines import chat_prompts, greedy, load_engine, make_seed_moe, run_all

NEXTN_ROLES = {"mtp.enorm.weight": "nextn.enorm.weight", "mtp.hnorm.weight": "nextn.hnorm.weight",
               "mtp.eh_proj.weight": "nextn.eh_proj.weight", "mtp.output_norm.weight": "nextn.shared_head_norm.weight"}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    base = make_seed_moe(tmp_path_factory.mktemp("seed-moe-nextn"))
    main = GGUFFile(base / "model.gguf")
    draft = GGUFFile(next((base / "mtp").glob("*.gguf")))
    arch = main.metadata["general.architecture"]
    n = int(main.metadata[f"{arch}.block_count"])
    out = base / "with-nextn.gguf"
    w = GGUFWriter(out, alignment=main.alignment)
    md = dict(main.metadata)
    types = dict(main.metadata_types)
    md[f"{arch}.block_count"] = n + 1
    md[f"{arch}.nextn_predict_layers"] = 1
    types.pop(f"{arch}.block_count", None)
    w.add_all_metadata(md, {k: v for k, v in types.items() if k in md})
    for name, t in main.tensors.items():
        w.add_tensor(name, t.ggml_type, t.shape, np.asarray(t.data()).tobytes())
    for name, t in draft.tensors.items():
        new = f"blk.{n}." + (NEXTN_ROLES.get(name) or name.removeprefix("mtp.blk."))
        w.add_tensor(new, t.ggml_type, t.shape, np.asarray(t.data()).tobytes())
    w.write()
    return base, out


def test_nextn_draft_inside_the_pack(packs):
    base, nextn_pack = packs
    plain, _ = load_engine(["--pack", str(base / "model.gguf"), "--device", "cpu"])
    core, lines = load_engine(["--pack", str(nextn_pack), "--spec", "3", "--parallel", "2", "--batch-mtp",
                               "--device", "cpu"])
    assert core.cfg.n_layer == plain.cfg.n_layer  # the nextn layer is not in the main stack
    assert any("nextn layer" in ln and "shared draft weights" in ln for ln in lines), lines
    assert any(ln.startswith("strata probe: batch-MTP on") for ln in lines), lines
    prompts = chat_prompts(plain, ["Hello there", "List three colors."])
    want = [ids for ids, _, _ in run_all(plain, prompts, greedy(12), threaded=False)]
    got = [ids for ids, _, _ in run_all(core, prompts, greedy(12), threaded=False)]
    assert got == want
    assert sum(s["mtp_drafted"] for s in core.metrics()["slots"]) > 0
