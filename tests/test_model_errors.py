"""Pack errors found while building the model: one line naming the culprit, exit code 2.

Each case rewrites a small synthetic pack with one defect and runs `strata generate` on it as a
real child process: missing required tensor, shape inconsistent with the metadata, unsupported
architecture, a prompt that does not fit --max-context.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from strata.pack.presets import TINY
    from strata.pack.synth import synth_pack

    out = tmp_path_factory.mktemp("tiny-llama")
    synth_pack(TINY["llama"], out, progress=lambda *a, **k: None)
    return next(out.glob("*.gguf"))


def rewrite(src: Path, dst: Path, *, drop: str | None = None, meta: dict | None = None) -> Path:
    g = GGUFFile(src)
    w = GGUFWriter(dst, alignment=g.alignment)
    md = dict(g.metadata)
    md.update(meta or {})
    types = {k: v for k, v in g.metadata_types.items() if k in md and k not in (meta or {})}
    w.add_all_metadata(md, types)
    for name, t in g.tensors.items():
        if name != drop:
            w.add_tensor(name, t.ggml_type, t.shape, np.asarray(t.data()).tobytes())
    w.write()
    return dst


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--device", "cpu",
                           "--prompt", "hi", "--max-tokens", "2", *args],
                          capture_output=True, text=True, timeout=120)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("strata: "), p.stderr
    return last


def test_missing_required_tensor(tiny, tmp_path):
    bad = rewrite(tiny, tmp_path / "bad.gguf", drop="blk.1.ffn_down.weight")
    line = one_line_error(run_generate("--pack", str(bad)))
    assert "missing required tensor blk.1.ffn_down.weight" in line


def test_shape_inconsistent_with_metadata(tiny, tmp_path):
    arch = GGUFFile(tiny).metadata["general.architecture"]
    n = GGUFFile(tiny).metadata[f"{arch}.feed_forward_length"]
    bad = rewrite(tiny, tmp_path / "bad.gguf", meta={f"{arch}.feed_forward_length": int(n) * 2})
    line = one_line_error(run_generate("--pack", str(bad)))
    assert "has shape" in line and "metadata implies" in line and "ffn_gate" in line


def test_unsupported_architecture(tiny, tmp_path):
    bad = rewrite(tiny, tmp_path / "bad.gguf", meta={"general.architecture": "mamba"})
    line = one_line_error(run_generate("--pack", str(bad)))
    assert "unsupported architecture 'mamba'" in line and "llama" in line


def test_prompt_longer_than_max_context(tiny):
    line = one_line_error(run_generate("--pack", str(tiny), "--max-context", "8"))
    assert "tokens but the context holds 8" in line
