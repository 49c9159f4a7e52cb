"""Every CUDA module Strata compiles at run time builds for the GPU generations it supports.

The GPU tests run on an H200 (sm_90); users run consumer and older datacenter cards (the bug
report came from an RTX 4090, sm_89). NVRTC compiles the kernels for the GPU it finds, so a
kernel that uses what an older part lacks (a Hopper instruction outside its guard, more static
shared memory or registers than it allows) would fail only there, at the first request. This
compiles every module of strata.kernels.cuda.catalog with nvcc for sm_80 (A100, the oldest
target), as the wrappers compile them: the same code, options and template instances. Every
architecture guard in the sources is at sm_90 (PDL, bulk copies), so sm_86 and sm_89 (RTX 30xx
and 40xx) build the same code as sm_80; STRATA_TEST_CUDA_ARCHS=80,86,89 compiles for those too
(about 80 s per architecture on 2 cores). It needs nvcc, not a GPU, and skips where there is none;
being that slow it is marked `nvcc`, left out of the default run: `python3 -m pytest -m nvcc`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from strata.kernels.cuda import catalog

NVCC = shutil.which("nvcc")
ARCHS = tuple(int(a) for a in os.environ.get("STRATA_TEST_CUDA_ARCHS", "80").split(","))

pytestmark = [pytest.mark.nvcc, pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit), no GPU")]


def _translation_unit(m: catalog.ModuleSource) -> str:
    """The module's code plus host code that takes each instance's address, which makes nvcc
    instantiate the templates NVRTC instantiates from the wrapper's name expressions."""
    if not m.instances:
        return m.code
    refs = ", ".join(f"(void*)&{name}" for name in m.instances)
    return m.code + f"\nstatic void* const strata_instances[] = {{{refs}}};\n"


def _compile(m: catalog.ModuleSource, arch: int, tmp: Path) -> str | None:
    """None if nvcc builds the module for sm_<arch>, else what it said."""
    src = tmp / (re.sub(r"\W+", "_", m.label) + f"_{arch}.cu")
    src.write_text(_translation_unit(m))
    cmd = [NVCC, f"-arch=sm_{arch}", "-cubin", "-o", str(src.with_suffix(".cubin")), "-diag-suppress", "177",
           *m.options, str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode == 0:
        return None
    errors = [ln for ln in (r.stderr + r.stdout).splitlines() if "error" in ln.lower()]
    return f"{m.label} for sm_{arch}: " + " | ".join((errors or [r.stderr.strip()])[:3])


def test_catalog_names_every_wrapper_module():
    labels = [m.label for m in catalog.modules()]
    for want in ("mmvq Q2_0", "mmvq IQ4_NL", "mmvq IQ3_S", "mmvq F16", "mmvq_wide", "dequant Q4_K", "fused", "sample",
                 "attention_prefill", "delta_net"):
        assert want in labels
    assert len(labels) == len(set(labels))


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
def test_every_module_compiles_for(arch):
    mods = [m for m in catalog.modules() if m.min_arch <= arch]
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(lambda m: _compile(m, arch, Path(d)), mods) if f]
    assert not failures, "\n".join(failures)
