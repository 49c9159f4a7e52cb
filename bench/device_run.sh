#!/bin/bash
# One device call of the CUDA work (see docs/notes/gpu-runs.md for each run's prediction and
# result). The test model is too large for one upload: stage "a" keeps its first half in /tmp,
# stage "b" (the next call, while the machine is warm) joins it with the second.
#   a: GPU tests; dense-8b pack synthesized and benchmarked
#   b: test model benchmarked (graphs vs eager vs llama.cpp), its GPU tests
set -o pipefail
export PYTHONUNBUFFERED=1 STRATA_TOKENIZER_GGUF=$PWD/.models/tokenizer.gguf
stage=$1; shift
case $stage in
t)  # GPU tests only, full log
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_prefill.py > $OUT/tests.log 2>&1
  tail -5 $OUT/tests.log
  ;;
p)  # GPU tests, a step profile and the engine bench on synthesized dense-8b and smollm-shaped packs
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -3 $OUT/tests.log
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('dense-8b', 'smollm'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  for p in /tmp/dense-8b /tmp/smollm; do python3 bench/gpu_step_profile.py --pack $p --steps 32; done 2>&1 | tee $OUT/profile.log
  python3 bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs --tokens 64 --runs 2 --ref 304,507,743,1008,9872 2>&1 | tail -6
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs --tokens 64 --runs 2 --ref 945,1488,2598,4530,49000 2>&1 | tail -6
  ;;
a)
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_prefill.py 2>&1 | tail -15 | tee $OUT/tests.log
  python3 -c "import time; t=time.time(); from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['dense-8b'], '/tmp/dense8b', progress=lambda s: None); print('dense-8b synthesized in %.0f s' % (time.time()-t))"
  python3 bench/bench_gpu_engine.py --pack /tmp/dense8b --modes graphs,eager --tokens 64 --runs 2 \
      --ref 304,507,743,1008,9872 "$@" 2>&1 | tee $OUT/dense8b.log
  ;;
b)
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs,eager --tokens 128 \
      --ref 945,1488,2598,4530,49000 "$@" 2>&1 | tee $OUT/testmodel.log
  ;;
esac
