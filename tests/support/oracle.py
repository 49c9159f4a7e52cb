"""llama.cpp as an oracle: its log-probs on synthetic packs, recorded into small JSON files that
CI compares Strata against (tests/test_llamacpp_oracle.py), and re-recorded where llama-cpp-python
is installed (`pip install -e .[oracle]`; it compiles llama.cpp, so it is never a dependency).

The oracle packs are the tiny preset of each architecture with every matrix in F16: llama.cpp's
CPU kernels then round activations to F16, not to 8 bits, so its log-probs and Strata's agree to
a few thousandths of a nat and a wrong layer (~1 nat) cannot hide in rounding noise. The packs
are rebuilt from their recipe (preset, seed, types) here; only llama.cpp's outputs are stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "llamacpp"
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")
TOKENS = [1, 200, 300, 4000, 50, 60, 70, 80, 9, 1234, 17, 3000]
# a seed whose MoE routers have no near-tie at these tokens (top-k margins >= 0.03 logits on the
# qwen35moe and qwen3next packs): at a tie, F16 rounding may pick another expert for one token in
# llama.cpp, a jump of ~0.5 nat that says nothing about either engine
SEED = 1
VOCAB = 4096
TOP = 8  # log-probs kept per position: the recorded top-8 tokens of llama.cpp


def oracle_spec(arch: str):
    from strata.pack.presets import ROLE_TENSORS, TINY

    spec = replace(TINY[arch], vocab=VOCAB)
    return spec.with_types({role: "F16" for role in ROLE_TENSORS})


def write_pack(arch: str, out: Path) -> Path:
    from strata.pack.synth import synth_pack

    (path,) = synth_pack(oracle_spec(arch), out, name=arch, seed=SEED, force=True, progress=lambda *a: None)
    return path


_CHILD = """
import json, sys
import numpy as np
import llama_cpp
path, tokens, top = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
m = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=True)
m.eval(tokens)
z = np.asarray(m.scores[: len(tokens)], dtype=np.float64)
z = z - z.max(axis=1, keepdims=True)
lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
ids = np.argsort(-lp, axis=1, kind="stable")[:, :top]
print(json.dumps({"ids": ids.tolist(), "logprobs": np.take_along_axis(lp, ids, 1).round(6).tolist()}))
"""


def record(arch: str, work: Path) -> dict:
    """llama.cpp's top log-probs on the oracle pack of `arch`, run in a child process (llama.cpp
    aborts the process on some errors: the test run survives it)."""
    import llama_cpp

    path = write_pack(arch, work / arch)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(TOKENS), str(TOP)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp on {path}: exit {proc.returncode}: {proc.stderr[-1500:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"arch": arch, "seed": SEED, "vocab": VOCAB, "types": "F16", "tokens": TOKENS,
            "llama_cpp_python": llama_cpp.__version__, **out}


def load(arch: str) -> dict:
    return json.loads((DATA / f"{arch}.json").read_text())


def save(rec: dict) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / f"{rec['arch']}.json").write_text(json.dumps(rec, separators=(",", ":")) + "\n")
