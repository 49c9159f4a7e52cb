"""Every CUDA module the backend compiles at run time, as the wrappers compile it.

The wrappers (mmvq, dequant, fused, sample, attention_prefill, delta_net) compile their sources with NVRTC
for the GPU they find, at first use. A user's GPU may be another generation than the one the
kernels were measured on (an sm_89 card: RTX 4090; sm_80 / sm_86: A100, RTX 30xx), so
tests/test_cuda_archs.py compiles every module listed here with nvcc for those targets, where
nvcc is installed (no GPU needed): a kernel that uses an instruction or a resource those parts
lack fails there, not on the user's machine.

    modules() -> list[ModuleSource]
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.kernels.ggml_types import BY_NAME, type_by_id


@dataclass(frozen=True)
class ModuleSource:
    """One module: its code, its compiler options (CuPy adds the target itself), the template
    instances its wrapper asks for (extern "C" kernels compile without being named), and the
    oldest compute capability that runs it (mmvq_wide needs sm_90's 200 KB of shared memory per
    block, and the wrappers never launch it elsewhere)."""

    label: str
    code: str
    options: tuple[str, ...]
    instances: tuple[str, ...] = ()
    min_arch: int = 80


def _mmvq_modules() -> list[ModuleSource]:
    from strata.kernels.cuda import experts as ex
    from strata.kernels.cuda import mmvq_build as b
    from strata.kernels.cuda import mmvq_policy as p

    code, opts = b.source(), b.OPTIONS
    out = [ModuleSource(f"mmvq {type_by_id(t).name}", code, opts, tuple(b.names(t))) for t in b.supported_types()]
    # the instances compiled apart, on demand (mmvq_build.named_function): the lean and groups-of-2
    # one-column instances, prefill's grouped experts, gate + up pairs (of the report's pack
    # types and of one type), and mmvq_wide
    rare = []
    for t in p.QUANT_TYPES:
        rare += [p.mmvq_name(t, 1, True, lean=True), p.mmvq_name(t, 1, True, 2), f"mmvq_grouped<{t}>", ex.mmq_name(t)]
    iq3s, iq3xxs, q4k = (BY_NAME[n].id for n in ("IQ3_S", "IQ3_XXS", "Q4_K"))
    for a, c in ((iq3s, iq3xxs), (q4k, q4k)):
        rare += [p.pair_name(a, c), p.pair_name(a, c, True)]
    out.append(ModuleSource("mmvq (instances compiled apart)", code, opts, tuple(rare)))
    wide = [p.wide_name(t, a, g) for t in b.KNOBS.wide_warps for a in (False, True) for g in (2, p.RPW)]
    out.append(ModuleSource("mmvq_wide", code, opts, tuple(wide), min_arch=90))
    return out


def modules() -> list[ModuleSource]:
    from strata.kernels.cuda import attention_prefill, delta_net, dequant, fused, sample

    fused_code, fused_names = fused.module_source()
    return (_mmvq_modules()
            + [ModuleSource(f"dequant {type_by_id(t).name}", dequant._source(), dequant._OPTIONS, tuple(dequant._names(t)))
               for t in dequant.supported_types()]
            + [ModuleSource("fused", fused_code, fused.OPTIONS, tuple(fused_names)),
               ModuleSource("sample", sample._SOURCE.read_text(), sample.OPTIONS),
               ModuleSource("attention_prefill", attention_prefill._SOURCE.read_text(), attention_prefill.OPTIONS),
               ModuleSource("delta_net", delta_net._SOURCE.read_text(), delta_net.OPTIONS)])
