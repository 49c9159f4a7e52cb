"""Dump the SASS of MMVQ kernel instances and count their instructions by opcode.

    python3 bench/probes/sass_mmvq.py --out DIR 'mmvq<42, 1>' 'mmvq<21, 1>'

Compiles Strata's MMVQ source with nvcc (-cubin, the NVRTC options mmvq_build uses) for the GPU
present, with the named instances instantiated explicitly, and writes DIR/<name>.sass plus a
table of opcode counts (static counts of the kernel body: where a loop's instructions sit is
for the reader of the .sass). Needs nvcc and cuobjdump (the device machine has both).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.kernels.cuda import mmvq_build  # noqa: E402

SIGNATURE = "(const u8*, int, int, int, int, const i8*, const QMeta*, float*)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", help="kernel instances, e.g. 'mmvq<42, 1>'")
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="")
    p.add_argument("-D", action="append", default=[], help="extra macro, NAME=VALUE")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arch = a.arch
    if not arch:
        import cupy

        arch = "sm_" + cupy.cuda.Device().compute_capability
    src = mmvq_build.source() + "".join(f"\ntemplate __global__ void {n}{SIGNATURE};" for n in a.names)
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "mmvq.cu"
        cu.write_text(src)
        cubin = Path(tmp) / "mmvq.cubin"
        opts = [o for o in mmvq_build.OPTIONS] + [f"-D{d}" for d in a.D]
        subprocess.run(["nvcc", "-cubin", f"-arch={arch}", *opts, "-o", str(cubin), str(cu)], check=True)
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    # split per function
    funcs = re.split(r"\n\s*Function : ", sass)
    print("| kernel | instructions | top opcodes |\n|---|---:|---|")
    for f in funcs[1:]:
        name, body = f.split("\n", 1)
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body)
        (out / (re.sub(r"\W+", "_", name.strip())[:80] + ".sass")).write_text(body)
        cnt = collections.Counter(o.split(".")[0] for o in ops)
        top = ", ".join(f"{k} {v}" for k, v in cnt.most_common(14))
        print(f"| {name.strip()[:40]} | {len(ops)} | {top} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
