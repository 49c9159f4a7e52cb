#!/bin/bash
# One device call of the CUDA work (see docs/notes/gpu-runs.md for each run's prediction and
# result). The test model is too large for one upload: stage "a" keeps its first half in /tmp,
# stage "b" (the next call, while the machine is warm) joins it with the second.
#   a: GPU tests; dense-8b pack synthesized and benchmarked
#   b: test model benchmarked (graphs vs eager vs llama.cpp), its GPU tests
set -o pipefail
export PYTHONUNBUFFERED=1 STRATA_TOKENIZER_GGUF=$PWD/.models/tokenizer.gguf
stage=$1; shift

# A final tree's check (sessions 11, 12): the first half of the test model to /tmp; every GPU test
# that does not need the model; dense-8b and seed-moe-full decode, new vs .gl/base.
tests_big_decode_tm_part1() {
  cp .models/tm.part1 /tmp/tm.part1
  timeout 330 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_pdl.py tests/test_cuda_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_env_knobs.py tests/test_cuda_decode_host.py tests/test_cuda_launch_layout.py tests/test_cuda_prefill_host.py \
      tests/test_cuda_attention_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  big_decode "new base"
}

# Session 12: IQ3_S MMVQ at 57344 and 28672 x 8192 under each labelled mmvq_wide configuration of
# $1, twice. The knobs of copies (WIDE_COPIES) and stages (WIDE_IN_FLIGHT) were removed after
# the runs (S12-4, S12-5: no configuration beat 32 copies x 16 warps x 2 stages).
iq3s_wide_configs() {
  for r in 1 2; do for c in $1; do
    case $c in
      c32w20) e="STRATA_MMVQ_WIDE_WARPS=20 STRATA_MMVQ_WIDE_SMEM=212000" ;;
      c32w22) e="STRATA_MMVQ_WIDE_WARPS=22 STRATA_MMVQ_WIDE_SMEM=224000" ;;
      c16w24) e="STRATA_MMVQ_WIDE_COPIES=16 STRATA_MMVQ_WIDE_WARPS=24" ;;
      c16s2) e="STRATA_MMVQ_WIDE_COPIES=16" ;;
      c16s3) e="STRATA_MMVQ_WIDE_COPIES=16 STRATA_MMVQ_WIDE_IN_FLIGHT=6272 STRATA_MMVQ_WIDE_SMEM=212000" ;;
      c32s3w12) e="STRATA_MMVQ_WIDE_IN_FLIGHT=6272 STRATA_MMVQ_WIDE_SMEM=212000 STRATA_MMVQ_WIDE_WARPS=12" ;;
      *) e="STRATA_X=1" ;;  # c32w16 / c32s2: the default
    esac
    for rows in 57344 28672; do
      env $e python3 bench/bench_mmvq.py --rows $rows --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c $rows] /"
    done
  done; done | tee $OUT/mmvq.log
}


# Same-call baselines (session 6): "base" is session 5's strata/ and bench/ and "head" the tree
# before the change under test, each a `git archive` under .gl/ (ignored, carried); run by path.
tree() { case $1 in base) echo .gl/base ;; head) echo .gl/base2 ;; *) echo . ;; esac; }

# Decode tok/s of the test model (/tmp/tm.gguf) for each label in $1, then dense-8b and
# seed-moe-full (synthesized here) for "new" and "base".
decode_vs_base() {
  for v in $1; do
    python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\| graphs \|" | sed "s/^/[$v] tm /"
  done
  synth_big
  big_decode "new base"
}

# The dense-8b and seed-moe-full packs under /tmp (random valid blocks at their real shapes).
synth_big() {
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('dense-8b', 'seed-moe-full'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
}

# Decode at B=1 and B=4 (and pp512) of each pack under /tmp in $1 (a pack may repeat), for each
# label in $2 in turn.
decode_pairs() {
  for p in $1; do
    for v in $2; do
      python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/$p --modes graphs --batches 1,4 --tokens 32 --runs 3 2>&1 \
          | tee -a $OUT/big.log | grep -E "^\| graphs \|" | sed "s/^/[$v] $p /"
    done
  done
}
big_decode() { decode_pairs "dense-8b seed-moe-full" "$1"; }

# The test model joined (/tmp/tm.part1 from the call before) and its GPU tests (GPU vs CPU,
# backend, window).
tm_join_and_test() {
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared timeout 300 python3 -m pytest -q tests/test_cuda_vs_cpu.py \
      tests/test_cuda_backend.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
}
# The test model's decode (all batch sizes, pp512) for each label in $1 in turn.
tm_decode() {
  for v in $1; do
    python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\| graphs \|" | sed "s/^/[$v] tm /"
  done
}
tm_joined_tests_decode() { tm_join_and_test; tm_decode "new base"; }

# Session 18: the window tests that take prompt windows and graphs, in the order whose capture
# once failed (S18-5); and pp512 (graphs mode) of the synthetic preset $1 under /tmp for each
# label in $2 in turn.
prompt_window_tests() {
  timeout ${1:-200} python3 -m pytest -q tests/test_cuda_window.py -k "long_prompt or invariance or wide or replay" > $OUT/tests_window.log 2>&1
  tail -1 $OUT/tests_window.log; grep -E "^(FAILED|E   )|capture of" $OUT/tests_window.log | head -20
}
pp512_vs() {
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['$1'], '/tmp/$1', progress=lambda s: None)"
  for v in $2; do
    timeout 100 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/$1 --modes graphs --batches 1 --tokens 8 --runs 3 2>&1 \
        | grep -E "pp512:|captured" | sed "s/^/[$v] /"
  done
}

# The MMVQ table (bench_mmvq.py --types $2 --cols $3) for each label in $1.
mmvq_vs() {
  for v in $1; do
    python3 $(tree $v)/bench/bench_mmvq.py --types $2 --cols $3 2>&1 | grep -vE "^strata" | sed "s/^/[$v] /"
  done | tee -a $OUT/mmvq.log
}

# bench_mtp (the test model, all 18 held-out prompts, median of 3) with the retrained draft
# (.models/new.mtp.gguf, carried), then with the draft shipped at the time (session 7's runs came
# before it was replaced). $1: options for both, $2: the new draft's, $3: the shipped one's.
drafts_vs_shipped() {
  for d in new old; do
    if [ $d = new ]; then draft=.models/new.mtp.gguf; more=$2; else draft=strata/mtp/data/smollm2-135m-instruct.mtp.gguf; more=$3; fi
    python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 6 --repeats 3 --draft $draft $1 $more > $OUT/mtp-$d.log 2>&1
    grep -E "\| all \||\| chat \||^1 slot|^\| [24] |greedy outputs|took" $OUT/mtp-$d.log | sed "s/^/[$d] /"
  done
}

# Session 9: decode of the test model (/tmp/tm.gguf), PDL on / off interleaved twice; of the
# dense-8b and seed-moe-full packs (/tmp, synth_big) at B=1 and 4, on / off once.
pdl_decode_tm() {
  for v in 1 0 1 0; do
    STRATA_CUDA_PDL=$v python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\| graphs \|" | sed "s/^/[pdl$v] tm /"
  done
}
pdl_decode_big() {
  for p in dense-8b seed-moe-full; do
    for v in 1 0; do
      STRATA_CUDA_PDL=$v python3 bench/bench_gpu_engine.py --pack /tmp/$p --modes graphs --batches 1,4 --tokens 32 --runs 3 2>&1 \
          | tee -a $OUT/big.log | grep -E "^\| graphs \|" | sed "s/^/[pdl$v] $p /"
    done
  done
}

T6=Q4_K,IQ3_S,Q2_0,IQ4_NL,Q2_K,Q4_1,Q8_0,Q4_0,Q6_K,Q5_0,Q5_K,IQ3_XXS,MXFP4
case $stage in
s16e)  # (S16-5) the final tree (rope's q/k norm weights before the wait only): window and pdl tests
  timeout 200 python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_pdl.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s16d)  # (its attention code dropped after the run, S16-4) (S16-4) rope's q/k norm weights before the wait, attention_kv_pre<d> (older keys into registers before the wait; the fusions dropped): window and pdl tests; chain profiles with STRATA_CUDA_ATT_PRELOAD on / off (seed-moe-full and dense-8b B=1, seed-moe-full B=4); decode new vs .gl/base
  timeout 200 python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_pdl.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  for w in 1 4; do for e in STRATA_X=1 STRATA_CUDA_ATT_PRELOAD=0; do
    env $e python3 bench/gpu_chain_profile.py --pack /tmp/seed-moe-full --width $w 2>&1 | grep -E "attention|all launches|wall" | sed "s/^/[$e B=$w moe] /"
  done; done | tee $OUT/chain.log
  for e in STRATA_X=1 STRATA_CUDA_ATT_PRELOAD=0; do
    env $e python3 bench/gpu_chain_profile.py --pack /tmp/dense-8b --width 1 2>&1 | grep -E "attention|all launches|wall" | sed "s/^/[$e B=1 dense] /"
  done | tee -a $OUT/chain.log
  decode_pairs "seed-moe-full" "new base"
  ;;
s16c)  # (its combine code dropped after the run, S16-3) (S16-3) s16b's router fusion dropped; the experts' sum in the next add + norm now its own instances (MIX: the expert loads at once), rope's q/k norm weights before the wait: window and pdl tests; seed-moe-full chain profile; seed-moe-full decode new vs .gl/base, three pairs; dense-8b one pair
  timeout 240 python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_pdl.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  python3 bench/gpu_chain_profile.py --pack /tmp/seed-moe-full --width 1 2>&1 | tee $OUT/chain.log | grep -vE "^strata"
  decode_pairs "seed-moe-full seed-moe-full seed-moe-full dense-8b" "new base"
  ;;
s16b)  # (its router and combine code dropped after the run, S16-2) (S16-2) the router's routing in its launch, the experts' sum in the next add + norm, rope's q/k norm weights before the wait: window, pdl and mmvq tests; seed-moe-full chain profile; seed-moe-full decode new vs .gl/base (HEAD before), two pairs
  timeout 330 python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_pdl.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  python3 bench/gpu_chain_profile.py --pack /tmp/seed-moe-full --width 1 2>&1 | tee $OUT/chain.log | grep -vE "^strata"
  decode_pairs "seed-moe-full seed-moe-full" "new base"
  ;;
s16a)  # (S16-1) where a decode window's chain time goes: bench/gpu_chain_profile.py (each kernel left out of the PDL graph) on seed-moe-full (B=1, 4) and dense-8b (B=1); decode B=1,4 of both
  synth_big
  (python3 bench/gpu_chain_profile.py --pack /tmp/seed-moe-full --width 1
   python3 bench/gpu_chain_profile.py --pack /tmp/dense-8b --width 1
   python3 bench/gpu_chain_profile.py --pack /tmp/seed-moe-full --width 4) 2>&1 | tee $OUT/chain.log | grep -vE "^strata"
  [ "$1" = decode ] && decode_pairs "seed-moe-full dense-8b" "new"
  ;;
s15g)  # (S15-7) after the review mend of _takes_lean: the mmvq and launch-layout tests; the rule's launches at 14336 x 4096 with and without the knobs
  timeout 300 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_launch_layout.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for e in STRATA_X=1 STRATA_MMVQ_LEAN=0 STRATA_MMVQ_LEAN=1 STRATA_MMVQ_ROWS_PER_WARP=8; do
    env $e python3 -c "
from strata.kernels.cuda import mmvq as m
from strata.kernels.ggml_types import type_by_name
for n in ('Q4_K', 'Q2_0'):
    print('$e', n, [(l.name, l.rpw) for l in m.column_launches(type_by_name(n).id, 14336, 1, aligned=True, k=4096)])"
  done
  ;;
s15f)  # (S15-6) the lean instance (2 stages) wherever one column of aligned rows in groups of 4 runs (STRATA_MMVQ_LEAN=1) against the rule, at the decode packs' larger shapes, twice
  for r in 1 2; do for shape in "28672 4096" "57344 8192" "6144 4096" "49152 4096" "4096 4096"; do set -- $shape
    for l in rule 1; do
      if [ $l = rule ]; then e="STRATA_X=1"; else e="STRATA_MMVQ_LEAN=1"; fi
      env $e python3 bench/bench_mmvq.py --rows $1 --k $2 --types Q4_K,Q6_K,IQ4_NL,Q2_0,Q8_0,Q4_0,Q5_K --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$1x$2 lean-$l] /"
    done
  done; done | tee $OUT/mmvq.log
  ;;
s15e)  # (S15-5) the paths a GPU before sm_90 takes (an RTX 4090: no PDL, no mmvq_wide, so no lean instance either), on the H200: every GPU test that needs no test model with STRATA_CUDA_PDL=0 STRATA_MMVQ_WIDE=0; the MMVQ table at 14336 x 4096, 1 and 4 columns, for the report's types on that path
  STRATA_CUDA_PDL=0 STRATA_MMVQ_WIDE=0 timeout 420 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_launch_layout.py \
      tests/test_cuda_pdl.py tests/test_cuda_window.py tests/test_cuda_prefill.py tests/test_cuda_sample.py tests/test_cuda_attention_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  STRATA_CUDA_PDL=0 STRATA_MMVQ_WIDE=0 python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,IQ3_XXS,Q2_0,IQ4_NL,Q6_K --cols 1,4 2>&1 | grep -vE "^strata" | sed "s/^/[sm80 path] /" | tee $OUT/mmvq.log
  ;;
s15d)  # (S15-4) the final tree: every GPU test that needs no test model (mmvq with the new lean list, launch layout, knobs, pdl, window, prefill, sample, attention); which launches take the lean instance at the shapes of the decode packs; 14336 x 4096 at 1 column for every type, and the four target types twice more
  timeout 420 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_launch_layout.py tests/test_cuda_env_knobs.py tests/test_cuda_pdl.py \
      tests/test_cuda_window.py tests/test_cuda_prefill.py tests/test_cuda_sample.py tests/test_cuda_attention_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "
from strata.kernels.cuda import mmvq as m
from strata.kernels.ggml_types import type_by_name
for n in 'Q4_K Q6_K Q4_0 Q8_0 IQ3_S IQ4_NL'.split():
    t = type_by_name(n).id
    for rows, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (49152, 4096), (14336, 4096), (2048, 2048), (4608, 2048), (1024, 2048), (2048, 4096)):
        ls = m.column_launches(t, rows, 1, aligned=True, k=k)
        if any(l.name.endswith('4, true>') for l in ls): print('lean at', n, rows, k, ls)
print('lean check done')
" 2>&1 | tee $OUT/lean_shapes.log
  ALL=Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,IQ4_NL,IQ4_XS,TQ1_0,TQ2_0,MXFP4,NVFP4,Q1_0,Q2_0
  python3 bench/bench_mmvq.py --types $ALL --cols 1 2>&1 | grep -vE "^strata" | sed "s/^/[final] /" | tee $OUT/mmvq.log
  for r in 1 2; do
    python3 bench/bench_mmvq.py --types Q4_K,IQ4_NL,IQ3_S,Q2_0 --cols 1 2>&1 | grep -E "^ *(Q|I)|rror|copy" | sed "s/^/[final] /"
  done | tee -a $OUT/mmvq.log
  ;;
s15c)  # (S15-3) lean instances with LEAN_STAGES stages (2, new; 3 = Q4_K's and IQ4_NL's before): the lean test for every quantized type (LEAN_TYPES=all); 14336 x 4096 at 1 column for every type, old / new / all types lean / IN_FLIGHT=1024; the four types of the target twice more; 57344 x 8192 under IN_FLIGHT 1024 / 3072 / 4608
  ALL=Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,IQ4_NL,IQ4_XS,TQ1_0,TQ2_0,MXFP4,NVFP4,Q1_0,Q2_0
  STRATA_MMVQ_LEAN_TYPES=$ALL timeout 300 python3 -m pytest -q tests/test_cuda_mmvq.py -k lean > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E  )" $OUT/tests.log | head -40
  for c in old new all2 if1024; do
    case $c in
      old) e="STRATA_MMVQ_LEAN_STAGES=3" ;;
      all2) e="STRATA_MMVQ_LEAN_TYPES=$ALL" ;;
      if1024) e="STRATA_MMVQ_IN_FLIGHT=1024" ;;
      *) e="STRATA_X=1" ;;
    esac
    env $e python3 bench/bench_mmvq.py --types $ALL --cols 1 2>&1 | grep -E "^ *(Q|I|T|M|N)|rror" | sed "s/^/[$c] /"
  done | tee $OUT/mmvq.log
  for r in 1 2; do for c in old new all2; do
    case $c in old) e="STRATA_MMVQ_LEAN_STAGES=3" ;; all2) e="STRATA_MMVQ_LEAN_TYPES=$ALL" ;; *) e="STRATA_X=1" ;; esac
    env $e python3 bench/bench_mmvq.py --types Q4_K,IQ4_NL,IQ3_S,Q2_0 --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c] /"
  done; done | tee -a $OUT/mmvq.log
  for f in 1024 3072 4608; do
    STRATA_MMVQ_IN_FLIGHT=$f python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_0,Q8_0,Q6_K,Q5_K,Q2_0,IQ4_NL,Q4_K,IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[57344 if$f] /"
  done | tee $OUT/mmvq57.log
  ;;
s15b)  # (S15-2) the probe's ring rows again, with "post" rows (early blocks that fetch nothing before the wait); IQ3_S through the lean instance with 2 stages (STRATA_MMVQ_IN_FLIGHT=1760: 7 blocks per SM, one wave at 14336 rows), the lean test with it; MMVQ at 14336 x 4096, twice
  python3 bench/bench_launch_ceiling.py --mb 16.5,25.2 2>&1 | tee $OUT/ceiling.log
  STRATA_MMVQ_LEAN_TYPES=Q4_K,IQ4_NL,IQ3_S STRATA_MMVQ_IN_FLIGHT=1760 python3 -c "
from strata.kernels.cuda import mmvq as m
for t in m.LEAN_TYPES:
    nm = m._mmvq_name(t, 1, True, lean=True); f = m._function(t, nm)
    print(nm, 'regs', f.num_regs, 'smem', f.shared_size_bytes, 'resident warps', m._resident_warps_of(f), m.column_launches(t, 14336, 1, aligned=True, k=4096))
" 2>&1 | tee $OUT/regs.log
  STRATA_MMVQ_LEAN_TYPES=Q4_K,IQ4_NL,IQ3_S STRATA_MMVQ_IN_FLIGHT=1760 timeout 200 python3 -m pytest -q tests/test_cuda_mmvq.py -k "lean or IQ3_S" 2>&1 | tail -3
  for r in 1 2; do for c in def if1760 lean3; do
    case $c in
      if1760) e="STRATA_MMVQ_IN_FLIGHT=1760" ;;
      lean3) e="STRATA_MMVQ_LEAN_TYPES=Q4_K,IQ4_NL,IQ3_S STRATA_MMVQ_IN_FLIGHT=1760" ;;
      *) e="STRATA_X=1" ;;
    esac
    env $e python3 bench/bench_mmvq.py --types IQ3_S,Q4_K,IQ4_NL,Q2_0 --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c] /"
  done; done | tee $OUT/mmvq.log
  ;;
s15a)  # co-resident launches (S15-1): registers and resident warps per 1-column instance; the launch-ceiling probe with its ring rows; MMVQ at 14336 x 4096, 1 column, rows per warp 4 (default rule) / 8 / 12 / 16, twice
  python3 -c "
from strata.kernels.cuda import mmvq as m
from strata.kernels.ggml_types import type_by_name
for n in 'Q2_0 IQ4_NL IQ3_S Q4_K Q4_0 Q6_K'.split():
    t = type_by_name(n).id
    for nm in (m._mmvq_name(t, 1, True), m._mmvq_name(t, 1, True, lean=True)):
        f = m._function(t, nm); print(n, nm, 'regs', f.num_regs, 'smem', f.shared_size_bytes, 'resident warps', m._resident_warps_of(f))
" 2>&1 | tee $OUT/regs.log
  python3 bench/bench_launch_ceiling.py --mb 16.5,25.2,33.0 2>&1 | tee $OUT/ceiling.log
  for r in 1 2; do for rpw in def 8 12 16; do
    if [ $rpw = def ]; then e="STRATA_X=1"; else e="STRATA_MMVQ_ROWS_PER_WARP=$rpw"; fi
    env $e python3 bench/bench_mmvq.py --types Q2_0,IQ4_NL,IQ3_S,Q4_K,Q4_0,Q6_K --cols 1 2>&1 | grep -E "^ *(Q|I)|rror|copy" | sed "s/^/[rpw $rpw] /"
  done; done | tee $OUT/mmvq.log
  ;;
s13b)  # add_rms_norm_q8 with its row in registers (fused.cu, S13-2): pdl and window tests; dense-8b and seed-moe-full decode, new vs .gl/base (HEAD before); first half of the test model to /tmp
  cp .models/tm.part1 /tmp/tm.part1
  timeout 200 python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  decode_pairs "dense-8b dense-8b seed-moe-full" "new base"
  ;;
s13c)  # the test model joined: its GPU tests (GPU vs CPU, backend, window) and decode, new vs .gl/base
  tm_joined_tests_decode
  ;;
s13i)  # (its code reverted after the run, S13-9) moe_route asks L2 for the chosen experts' gate, up and down weights (S13-9): window + pdl tests; seed-moe-full decode new vs .gl/base2, two pairs
  timeout 150 python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  decode_pairs "seed-moe-full seed-moe-full" "new head"
  ;;
s13g)  # the final tree: every GPU test that does not need the test model; its first half to /tmp
  cp .models/tm.part1 /tmp/tm.part1
  timeout 420 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_pdl.py tests/test_cuda_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_env_knobs.py tests/test_cuda_decode_host.py tests/test_cuda_launch_layout.py tests/test_cuda_prefill_host.py \
      tests/test_cuda_attention_prefill.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s13h)  # the final tree: the test model joined, its GPU tests
  tm_join_and_test
  ;;
s13f)  # mmvf (the MoE router's float mat-vec) launched with PDL, its row asked into L2 before the wait, x through weak loads (S13-6): float mmvq, pdl and window tests; seed-moe-full decode new vs .gl/base2, three pairs
  timeout 200 python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_window.py tests/test_cuda_mmvq.py -k "F32 or F16 or BF16 or float or pdl or window or moe or route" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  decode_pairs "seed-moe-full seed-moe-full seed-moe-full" "new head"
  ;;
s13d)  # window and cache tables, cos/sin and the older cache rows (L2) before the PDL wait in rope_kv_write / attention_kv (S13-5): pdl + window tests; dense-8b and seed-moe-full decode, new vs .gl/base2 (HEAD before), interleaved; first half of the test model to /tmp
  cp .models/tm.part1 /tmp/tm.part1
  timeout 200 python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  decode_pairs "dense-8b dense-8b dense-8b seed-moe-full seed-moe-full" "new head"
  ;;
s13e)  # the test model joined: its GPU tests (GPU vs CPU, backend, window) and decode, new vs .gl/base2, twice
  tm_join_and_test
  tm_decode "new head new head"
  ;;
s14g)  # (its code and knob reverted after the run, S14-8) mmvq_wide fills its stages by bulk copies (TMA, cp.async.bulk + an mbarrier per stage; WIDE_BULK, S14-8): wide and IQ3 mmvq tests; IQ3_S and IQ3_XXS at 57344 / 28672 x 8192 and 4096 x 14336, bulk on / off, three times
  timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py -k "IQ3 or wide or launch" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for r in 1 2 3; do for t in 1 0; do
    STRATA_MMVQ_WIDE_BULK=$t python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[b$t 57344] /"
    [ $r = 1 ] && STRATA_MMVQ_WIDE_BULK=$t python3 bench/bench_mmvq.py --rows 28672 --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[b$t 28672] /"
    [ $r = 1 ] && STRATA_MMVQ_WIDE_BULK=$t python3 bench/bench_mmvq.py --rows 4096 --k 14336 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[b$t 4096x14336] /"
  done; done | tee $OUT/mmvq.log
  ;;
s14f)  # (its code and knob reverted after the run, S14-7) IQ3_S's sign masks from a table in mmvq_wide (WIDE_SIGN_TABLE, S14-7): wide and IQ3 mmvq tests; IQ3_S at 57344 / 28672 x 8192 and 4096 x 14336, table on / off, three times
  timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py -k "IQ3 or wide or launch" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for r in 1 2 3; do for t in 1 0; do
    STRATA_MMVQ_WIDE_SIGN_TABLE=$t python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[t$t 57344] /"
    [ $r = 1 ] && STRATA_MMVQ_WIDE_SIGN_TABLE=$t python3 bench/bench_mmvq.py --rows 28672 --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[t$t 28672] /"
    [ $r = 1 ] && STRATA_MMVQ_WIDE_SIGN_TABLE=$t python3 bench/bench_mmvq.py --rows 4096 --k 14336 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[t$t 4096x14336] /"
  done; done | tee $OUT/mmvq.log
  ;;
s14e)  # Nsight Compute on mmvq_wide IQ3_S at 57344 x 8192: warp states, scheduler, pipes, and stall samples per SASS instruction (S14-6)
  ncu --clock-control none -k regex:mmvq_wide -c 1 --section WarpStateStats --section SourceCounters --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section InstructionStats --section SpeedOfLight -o /tmp/iq3s \
      python3 bench/ncu_mmvq.py IQ3_S --rows 57344 --k 8192 > $OUT/ncu_run.txt 2>&1
  tail -3 $OUT/ncu_run.txt
  ncu -i /tmp/iq3s.ncu-rep --page details > $OUT/details.txt 2>&1
  ncu -i /tmp/iq3s.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
  ncu -i /tmp/iq3s.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
  grep -iE "stall|eligible|issued|busy|pipe" $OUT/details.txt | head -60
  wc -c $OUT/*
  ;;
s14d)  # the committed probe (helpers from bench_mmvq, one kernel body for plain / pdl_pre / pdl_post and one for the tiles rows) beside the Q2_0, IQ4_NL and Q4_K MMVQ at 14336 x 4096, same call (S14-5)
  timeout 150 python3 bench/bench_launch_ceiling.py --mb 16.5,33.0 2>&1 | tee $OUT/ceiling.log
  python3 bench/bench_mmvq.py --types Q2_0,IQ4_NL,Q4_K --cols 1 2>&1 | grep -E "^ *(Q|I)|rror|copy" | tee $OUT/mmvq.log
  ;;
s14c)  # (the FULL_TILES code and knob reverted after the run, S14-3) full tiles without the per-chunk guard (FULL_TILES: 1 mmvq_wide, 2 every kernel; S14-3): mmvq tests with 2; MMVQ twice; the ceiling probe with no wait and with halves (S14-4)
  STRATA_MMVQ_FULL_TILES=2 timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  timeout 150 python3 bench/bench_launch_ceiling.py --mb 16.5,25.2,33.0 2>&1 | tee $OUT/ceiling.log
  for r in 1 2; do
    for ft in 0 1; do
      STRATA_MMVQ_FULL_TILES=$ft python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[ft$ft big] /"
    done
    for ft in 0 2; do
      STRATA_MMVQ_FULL_TILES=$ft python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q2_0,IQ4_NL,Q4_K --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[ft$ft big] /"
      STRATA_MMVQ_FULL_TILES=$ft python3 bench/bench_mmvq.py --types Q2_0,IQ4_NL,Q4_K,IQ3_S --cols 1,4 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[ft$ft] /"
    done
  done | tee $OUT/mmvq.log
  ;;
s14b)  # the launch ceiling probe with arithmetic after the wait and the next launch's share asked into L2 (S14-2)
  timeout 200 python3 bench/bench_launch_ceiling.py --mb 16.5,25.2,33.0,132.1 2>&1 | tee $OUT/ceiling.log
  # Q2_0 (and Q4_0) through the lean instance at 14336 x 4096: 75 registers keep 24 warps per SM
  # (3168 of the 3584 warps); the lean one holds 7 blocks (28 warps) and would run one wave
  for r in 1 2; do for lean in 0 1; do
    python3 - $lean <<'PY' 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[lean=$lean] /"
import sys
sys.path.insert(0, "bench")
import bench_mmvq
from strata.kernels.cuda import mmvq
from strata.kernels.ggml_types import type_by_name
if sys.argv[1] == "1":
    mmvq.LEAN_TYPES = mmvq.LEAN_TYPES + (type_by_name("Q2_0").id, type_by_name("Q4_0").id)
bench_mmvq.main(["--types", "Q2_0,Q4_0", "--cols", "1"])
PY
  done; done | tee $OUT/mmvq.log
  ;;
s14a)  # (its code and knobs reverted after the run, S14-1) IQ3_S's sign-mask sources held in registers (h) and the first tiles issued before the codebook copy (e) (S14-1): mmvq tests with both; MMVQ under each combination, twice; the launch ceiling with and without PDL
  timeout 300 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_launch_layout.py tests/test_cuda_env_knobs.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  timeout 60 python3 bench/bench_launch_ceiling.py 2>&1 | tee $OUT/ceiling.log
  for r in 1 2; do for c in h0e0 h1e0 h0e1 h1e1; do
    e="STRATA_MMVQ_HOLD_SIGN_SOURCES=${c:1:1} STRATA_MMVQ_EARLY_TILES=${c:3:1}"
    env $e python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c big] /"
    env $e python3 bench/bench_mmvq.py --types IQ3_S,IQ4_NL,Q2_0,Q4_K --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c] /"
  done; done | tee $OUT/mmvq.log
  ;;
s13a)  # (its code reverted after the run, S13-1) the next launch's weights asked into L2 (prefetch_share, pdl.cuh): mmvq tests; 1 column with and without, at the warps' end (default), at the start (PF_START), 8 MB at most
  timeout 240 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_launch_layout.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for c in end start mb8; do
    e="STRATA_X=1"; [ $c = start ] && e="STRATA_MMVQ_PF_START=1"; [ $c = mb8 ] && e="STRATA_MMVQ_PREFETCH_MB=8"
    env $e python3 bench/bench_mmvq.py --types Q2_0,IQ4_NL,IQ3_S,Q4_K --cols 1 --prefetch 2>&1 | grep -E "^ *(Q|I)|rror|copy" | sed "s/^/[$c] /"
  done | tee $OUT/mmvq.log
  python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,Q2_0 --cols 1 --prefetch 2>&1 | grep -E "^ *(Q|I)|rror|copy" | sed "s/^/[big] /" | tee -a $OUT/mmvq.log
  ;;
s12m)  # IQ3_S, more of the integer pipe's work on the multiply-add pipe: dp2a addresses (d), + scale 1 + 2s by an fma (s), + right shifts by mul.hi (m): tests with all; MMVQ, twice (s and m, and the knobs, dropped after the run: S12-14)
  STRATA_MMVQ_IQ3S_DP2A=1 STRATA_MMVQ_IQ3S_SCALE_FMA=1 STRATA_MMVQ_IQ3S_MULHI=1 timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py \
      -k "IQ3_S or wide" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for r in 1 2; do for c in d ds dsm; do
    e="STRATA_MMVQ_IQ3S_DP2A=1"; [ $c != d ] && e="$e STRATA_MMVQ_IQ3S_SCALE_FMA=1"; [ $c = dsm ] && e="$e STRATA_MMVQ_IQ3S_MULHI=1"
    env $e python3 bench/bench_mmvq.py --types IQ3_S --cols 1,4 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c] /"
    env $e python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c big] /"
  done; done | tee $OUT/mmvq.log
  ;;
s12l)  # IQ3_S grid addresses by dp2a (two indices per prmt, the multiply-add on the FMA pipe; knob IQ3S_DP2A, the default after the run, S12-13): mmvq tests with it; IQ3_S MMVQ on / off, twice
  STRATA_MMVQ_IQ3S_DP2A=1 timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py -k "IQ3_S or wide" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for r in 1 2; do for v in 1 0; do
    STRATA_MMVQ_IQ3S_DP2A=$v python3 bench/bench_mmvq.py --types IQ3_S --cols 1,4 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[dp2a$v] /"
    STRATA_MMVQ_IQ3S_DP2A=$v python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[dp2a$v big] /"
  done; done | tee $OUT/mmvq.log
  ;;
s12k)  # decode with 64 MiB-and-up IQ3_S matrices: a 70B-class llama cut to 8 layers (n_embd 8192, ff 28672; gate+up 57344 x 8192 and down 8192 x 28672 IQ3_S), mmvq_wide on / off (STRATA_MMVQ_WIDE=0), interleaved twice
  python3 -c "import dataclasses, time; from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
t = time.time(); s = dataclasses.replace(PRESETS['dense-8b'], n_layer=8, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8, head_dim=128)
synth_pack(s.with_types({'ffn_gate': 'IQ3_S', 'ffn_up': 'IQ3_S', 'ffn_down': 'IQ3_S'}), '/tmp/d70-iq3s', progress=lambda s: None); print('synthesized in %.0f s' % (time.time() - t))"
  for v in on off on off; do
    [ $v = off ] && export STRATA_MMVQ_WIDE=0 || unset STRATA_MMVQ_WIDE
    timeout 90 python3 bench/bench_gpu_engine.py --pack /tmp/d70-iq3s --modes graphs --batches 1 --tokens 32 --runs 3 2>&1 \
        | grep -E "^\| graphs \||rror" | sed "s/^/[wide $v] d70-iq3s /"
  done
  ;;
s12j)  # mmvq_wide rows spread evenly over the grid's warps (every SM a block; 128 of 132 before; dropped after this run, S12-11): every GPU test without the test model; IQ3 MMVQ new / HEAD (.gl/base2), twice
  timeout 330 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_pdl.py tests/test_cuda_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_env_knobs.py tests/test_cuda_decode_host.py tests/test_cuda_launch_layout.py tests/test_cuda_prefill_host.py \
      tests/test_cuda_attention_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new head new head; do
    for rows in 57344 28672; do
      python3 $(tree $v)/bench/bench_mmvq.py --rows $rows --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $rows] /"
    done
    python3 $(tree $v)/bench/bench_mmvq.py --rows 4096 --k 14336 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v 4096x14336] /"
  done | tee $OUT/mmvq.log
  ;;
s12i)  # lean one-column instance (CPL 1, 7 blocks per SM) where 14336 rows need one wave of it: tests; MMVQ new / HEAD (.gl/base2, TilePtr) / session start (.gl/base), twice
  timeout 240 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_launch_layout.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new head base new head base; do
    python3 $(tree $v)/bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v big] /"
  done | tee $OUT/mmvq.log
  ;;
s12h)  # 14336 x 4096 at 1 column: more resident warps (registers held by NARROW_MIN_BLOCKS, smaller tiles by CPL_MAX=1) so that 3584 warps fit one wave; twice
  for r in 1 2; do for c in def nmb6 nmb7c1 c1; do
    case $c in
      nmb6) e="STRATA_MMVQ_NARROW_MIN_BLOCKS=6" ;;
      nmb7c1) e="STRATA_MMVQ_NARROW_MIN_BLOCKS=7 STRATA_MMVQ_CPL_MAX=1" ;;
      c1) e="STRATA_MMVQ_CPL_MAX=1" ;;
      *) e="STRATA_X=1" ;;
    esac
    env $e python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c] /"
    env $e python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$c big] /"
  done; done | tee $OUT/mmvq.log
  ;;
s12f)  # TilePtr tree: GPU tests without the test model; seed-moe-full and dense-8b decode new vs HEAD (.gl/base); first half of the test model
  tests_big_decode_tm_part1
  ;;
s12g)  # the test model joined: GPU tests with it; its decode new vs HEAD (.gl/base); seed-moe-full pp512 (eager, noisy in s12f) interleaved twice
  tm_joined_tests_decode
  for v in new base new base; do
    python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs --batches 1 --tokens 8 --runs 3 2>&1 \
        | tee -a $OUT/big.log | grep -E "^\| graphs \|" | sed "s/^/[$v] seed-moe-full /"
  done
  ;;
s12e)  # mmvq_wide IQ3_S: more warps per block now that it takes 80 registers: 32 copies x 16 / 20 / 22 warps, 16 copies x 24; twice
  iq3s_wide_configs "c32w16 c32w20 c32w22 c16w24"
  ;;
s12d)  # mmvq_wide IQ3_S: 16 codebook copies (32 KB) and 3 stages (one more item in flight per warp) vs 32 copies, 2 stages; twice
  iq3s_wide_configs "c32s2 c16s2 c16s3 c32s3w12"
  ;;
s12c)  # mmvq_wide in groups of 8 rows (one chunk per lane, the same shared memory) vs 4, IQ3 at 57344 / 28672 x 8192; twice
  for r in 1 2; do for c in g4 g8c1 g4c1; do
    e="STRATA_MMVQ_WIDE_GROUP="; [ $c = g8c1 ] && e="STRATA_MMVQ_WIDE_GROUP=8 STRATA_MMVQ_CPL_MAX=1"; [ $c = g4c1 ] && e="STRATA_MMVQ_CPL_MAX=1"
    for rows in 57344 28672; do
      env $e python3 bench/bench_mmvq.py --rows $rows --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$c $rows] /"
    done
  done; done | tee $OUT/mmvq.log
  ;;
s12b)  # which half of s12a does what: TILE_PTR / HIDE_SB knobs 11 / 10 / 01 / 00, twice interleaved
  for r in 1 2; do for c in 11 10 01 00; do
    STRATA_MMVQ_TILE_PTR=${c:0:1} STRATA_MMVQ_HIDE_SB=${c:1:1} python3 bench/bench_mmvq.py --types IQ3_S,Q3_K,IQ4_NL,Q4_K --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$c] /"
    STRATA_MMVQ_TILE_PTR=${c:0:1} STRATA_MMVQ_HIDE_SB=${c:1:1} python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$c big] /"
  done; done | tee $OUT/mmvq.log
  ;;
s12a)  # TilePtr (a block's tile offset per lane: alignment arithmetic once for a warp's rows) and the warp's buffer hidden from the compiler: tests; MMVQ new / HEAD (.gl/base), twice interleaved
  timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new base new base; do
    python3 $(tree $v)/bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL,Q3_K,Q8_0 --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,Q2_0,IQ4_NL,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v big] /"
  done | tee $OUT/mmvq.log
  ;;
s11m)  # dense-8b with IQ3_S FFN matrices (down projections take mmvq_wide): decode new / WIDE=0 / session start (.gl/base)
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['dense-8b'].with_types({'ffn_gate': 'IQ3_S', 'ffn_up': 'IQ3_S', 'ffn_down': 'IQ3_S'}), '/tmp/d8-iq3s', progress=lambda s: None)"
  for v in new w0 base new w0; do
    t=$(tree $v); [ $v = w0 ] && export STRATA_MMVQ_WIDE=0 || unset STRATA_MMVQ_WIDE
    timeout 60 python3 $t/bench/bench_gpu_engine.py --pack /tmp/d8-iq3s --modes graphs --batches 1 --tokens 32 --runs 3 2>&1 \
        | grep -E "^\| graphs \||rror" | sed "s/^/[$v] d8-iq3s /"
  done
  ;;
s11l)  # IQ3_S fields by 16-bit loads (no alignment arithmetic; dropped after this run, S11-12): tests; IQ3_S MMVQ new / HEAD (.gl/base2), twice interleaved
  timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new head new head; do
    for s in "57344 8192" "28672 8192" "14336 4096" "4096 14336"; do
      python3 $(tree $v)/bench/bench_mmvq.py --rows ${s% *} --k ${s#* } --types IQ3_S --cols 1,4 2>&1 | grep -E "^ *(Q|I)|rror" | sed "s/^/[$v $s] /"
    done
  done | tee $OUT/mmvq.log
  ;;
s11k)  # groups of 2 rows (STRATA_MMVQ_GROUP, a knob removed after this run: S11-11) at 14336 x 4096 and 28672 x 4096, 1 column, vs the rule's 4; twice interleaved
  for rep in 1 2; do
    for g in 4 2; do
      for s in "14336 4096" "28672 4096"; do
        STRATA_MMVQ_GROUP=$g python3 bench/bench_mmvq.py --rows ${s% *} --k ${s#* } --types Q4_K,Q2_0,IQ4_NL,IQ3_S,Q6_K,Q8_0 --cols 1 2>&1 \
          | grep -E "^ *(Q|I)|rror" | sed "s/^/[g$g $s] /"
      done
    done
  done | tee $OUT/mmvq.log
  ;;
s11j)  # mmvq_wide: L2 prefetch of each warp's first rows before the codebook copy, 0 / 4 KB / 16 KB / 64 KB, twice interleaved (S11-10; the knob went with the idea)
  for rep in 1 2; do
    for pf in 0 4096 16384 65536; do
      for s in "57344 8192" "28672 8192" "4096 14336"; do
        STRATA_MMVQ_WIDE_PREFETCH=$pf python3 bench/bench_mmvq.py --rows ${s% *} --k ${s#* } --types IQ3_S,IQ3_XXS --cols 1 2>&1 \
          | grep -E "^ *(Q|I)|rror" | sed "s/^/[pf$pf $s] /"
      done
    done
  done | tee $OUT/mmvq.log
  ;;
s11h)  # final tree: GPU tests without the test model; seed-moe-full and dense-8b decode new vs HEAD (.gl/base); first half of the test model
  tests_big_decode_tm_part1
  ;;
s11i)  # the test model joined: GPU tests with it; its decode new vs HEAD (.gl/base)
  tm_joined_tests_decode
  ;;
s11g)  # mmvq_wide IQ3_S: more warps per block (up to 20 / 22, 225 KB), vs 16; twice
  for rep in 1 2; do
    for cfg in "16 204800" "20 230400" "22 230400"; do
      set -- $cfg
      for s in "57344 8192" "28672 8192" "4096 14336"; do
        STRATA_MMVQ_WIDE_WARPS=$1 STRATA_MMVQ_WIDE_SMEM=$2 python3 bench/bench_mmvq.py --rows ${s% *} --k ${s#* } --types IQ3_S --cols 1 2>&1 \
          | grep -E "^ *(Q|I)|rror" | sed "s/^/[w$1 $s] /"
      done
    done
  done | tee $OUT/mmvq.log
  ;;
s11f)  # mmvq_wide IQ3_S: fewer warps with more stages in flight (WIDE_WARPS / IN_FLIGHT / WIDE_SMEM), twice
  for rep in 1 2; do
    for cfg in "16 3072 204800" "12 6000 204800" "10 9000 215040" "14 3072 204800"; do
      set -- $cfg
      for s in "57344 8192" "28672 8192"; do
        STRATA_MMVQ_WIDE_WARPS=$1 STRATA_MMVQ_IN_FLIGHT=$2 STRATA_MMVQ_WIDE_SMEM=$3 python3 bench/bench_mmvq.py --rows ${s% *} --k ${s#* } --types IQ3_S --cols 1 2>&1 \
          | grep -E "^ *(Q|I)" | sed "s/^/[w$1 f$2 $s] /"
      done
    done
  done | tee $OUT/mmvq.log
  ;;
s11e)  # mmvq_wide on matrices >= 16 MiB, IQ3_XXS up to 24 warps: tests; IQ3 MMVQ new / WIDE=0, 4 shapes, twice
  timeout 250 python3 -m pytest -q -x tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new w0 new w0; do
    [ $v = w0 ] && export STRATA_MMVQ_WIDE=0 || unset STRATA_MMVQ_WIDE
    for s in "57344 8192" "28672 8192" "14336 4096" "4096 14336"; do
      set -- $s
      python3 bench/bench_mmvq.py --rows $1 --k $2 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $1x$2] /"
    done
  done | tee $OUT/mmvq.log
  ;;
s11d)  # mmvq_wide with its warps per block chosen for the busiest last round: tests; IQ3 MMVQ new / WIDE=0 / HEAD (.gl/base) over 6 shapes, twice
  timeout 250 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_pdl.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new w0 base new w0 base; do
    t=$(tree $v); [ $v = w0 ] && export STRATA_MMVQ_WIDE=0 || unset STRATA_MMVQ_WIDE
    for s in "57344 8192" "28672 8192" "14336 4096" "4096 14336" "4096 4096" "1024 4096"; do
      set -- $s
      python3 $t/bench/bench_mmvq.py --rows $1 --k $2 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $1x$2] /"
    done
  done | tee $OUT/mmvq.log
  ;;
s11c)  # mmvq_wide's shape: warps per block 16 / 20 / 24 and rows per group 4 / 2, IQ3_S and IQ3_XXS, twice (STRATA_MMVQ_WIDE_GROUP was removed after session 11)
  for rep in 1 2; do
    for cfg in "16 4 204800" "16 2 204800" "24 2 204800" "20 4 215040" "20 2 204800"; do
      set -- $cfg
      for s in "57344 8192" "14336 4096" "4096 14336"; do
        STRATA_MMVQ_WIDE_WARPS=$1 STRATA_MMVQ_WIDE_GROUP=$2 STRATA_MMVQ_WIDE_SMEM=$3 python3 bench/bench_mmvq.py --rows ${s% *} --k ${s#* } --types IQ3_S,IQ3_XXS --cols 1 2>&1 \
          | grep -E "^ *(Q|I)" | sed "s/^/[w$1 g$2 $s] /"
      done
    done
  done | tee $OUT/mmvq.log
  ;;
s11b)  # IQ3 codebook in 32 copies (mmvq_wide, 16-warp blocks): tests; MMVQ new / new WIDE=0 / HEAD (.gl/base), rows per warp one wave vs 4
  timeout 250 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_decode_host.py tests/test_cuda_pdl.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new w0 base new w0 base; do
    t=$(tree $v); [ $v = w0 ] && export STRATA_MMVQ_WIDE=0 || unset STRATA_MMVQ_WIDE
    for s in "57344 8192" "14336 4096" "4096 14336" "4096 4096"; do
      set -- $s
      python3 $t/bench/bench_mmvq.py --rows $1 --k $2 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $1x$2] /"
    done
  done | tee $OUT/mmvq.log
  unset STRATA_MMVQ_WIDE
  for r in 4 8; do
    STRATA_MMVQ_ROWS_PER_WARP=$r python3 bench/bench_mmvq.py --rows 14336 --k 4096 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[rpw$r 14336x4096] /"
    STRATA_MMVQ_ROWS_PER_WARP=$r python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[rpw$r 57344x8192] /"
  done
  ;;
s11a)  # IQ3_S signs by a bit transpose and one prmt per word, odd-grid sign by LOP3 (no raw form): tests; MMVQ vs HEAD (.gl/base), interleaved twice
  timeout 200 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new base new base; do
    python3 $(tree $v)/bench/bench_mmvq.py --types IQ3_S,IQ3_XXS --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v big] /"
  done | tee $OUT/mmvq.log
  ;;
s10n)  # every quantized type at RPW rows per warp at 1 column under PDL: tests; MMVQ and dense-8b decode vs HEAD (.gl/base3)
  timeout 150 python3 -m pytest -q -x tests/test_cuda_mmvq.py tests/test_cuda_window.py tests/test_cuda_pdl.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,Q8_0,Q6_K --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[new big] /"
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['dense-8b'], '/tmp/dense-8b', progress=lambda s: None)"
  for v in new head3; do
    t=.; [ $v = head3 ] && t=.gl/base3
    python3 $t/bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs --batches 1,4 --tokens 32 --runs 3 2>&1 \
        | grep -E "^\| graphs \|" | sed "s/^/[$v] dense-8b /"
  done
  ;;
s10m)  # Q8_0 at 1 column (s10l: 23.3 us, slower than its 2 and 4 columns): PDL on / off, session-9 tree, rows per warp 4 / 8
  for v in new base; do
    for pdl in 1 0; do
      STRATA_CUDA_PDL=$pdl python3 $(tree $v)/bench/bench_mmvq.py --types Q8_0,Q5_0,Q4_0 --cols 1,2 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v pdl$pdl] /"
    done
  done
  for r in 4 8 16; do
    STRATA_MMVQ_ROWS_PER_WARP=$r python3 bench/bench_mmvq.py --types Q8_0,Q5_0 --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[rpw $r] /"
  done
  ;;
s10l)  # the full MMVQ table on the final tree (every type, 1 / 2 / 4 / 8 columns; 57344 x 8192 at 1 column)
  python3 bench/bench_mmvq.py --cols 1,2,4,8 2>&1 | tee $OUT/table.log | grep -E "^ *(Q|I|T|M|N|F|B|device)"
  python3 bench/bench_mmvq.py --rows 57344 --k 8192 --cols 1 2>&1 | tee $OUT/big.log | grep -E "^ *(Q|I|T|M|N|F|B|device)"
  ;;
s10k)  # final rule (groups of 2 on matrices of >= 6 MiB that leave slots empty): tests; MMVQ at dense-8b's shapes vs HEAD~2 (.gl/base2); dense-8b decode
  timeout 200 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_pdl.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new head; do
    for s in "14336 4096" "4096 14336" "4096 4096" "1024 4096"; do
      set -- $s
      python3 $(tree $v)/bench/bench_mmvq.py --rows $1 --k $2 --types Q4_K,Q6_K,IQ4_NL,Q2_0,IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $1x$2] /"
    done
  done | tee $OUT/mmvq.log
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['dense-8b'], '/tmp/dense-8b', progress=lambda s: None)"
  for v in new head new head; do
    python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs --batches 1,4 --tokens 32 --runs 3 2>&1 \
        | tee -a $OUT/big.log | grep -E "^\| graphs \|" | sed "s/^/[$v] dense-8b /"
  done
  ;;
s10i)  # 2 or 1 rows per group for matrices of few rows, Q6_K decode-heavy: MMVQ at dense-8b's shapes vs HEAD (.gl/base2); tests; big decode
  cp .models/tm.part1 /tmp/tm.part1
  for v in new head new head; do
    for s in "14336 4096" "4096 14336" "4096 4096" "1024 4096"; do
      set -- $s
      python3 $(tree $v)/bench/bench_mmvq.py --rows $1 --k $2 --types Q4_K,Q6_K,IQ4_NL,Q2_0,IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $1x$2] /"
    done
  done | tee $OUT/mmvq.log
  timeout 240 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_pdl.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  [ -d /tmp/dense-8b ] || synth_big
  big_decode "new head new head"
  ;;
s10j)  # the test model joined: GPU tests with it; its decode new vs HEAD
  tm_join_and_test
  tm_decode "new head new head"
  for v in new head; do  # groups of 2 at least (1 lost at 1024 rows in s10i)
    for s in "4096 4096" "1024 4096"; do
      set -- $s
      python3 $(tree $v)/bench/bench_mmvq.py --rows $1 --k $2 --types Q4_K,Q6_K,Q2_0,IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v $1x$2] /"
    done
  done | tee $OUT/mmvq.log
  ;;
s10h)  # rows per warp at dense-8b's FFN shapes (14336 x 4096 and 4096 x 14336), 1 column: the rule's choice vs 4 / 8, twice
  for pass in 1 2; do
    for r in rule 4 8; do
      e=""; [ $r != rule ] && e="STRATA_MMVQ_ROWS_PER_WARP=$r"
      env $e python3 bench/bench_mmvq.py --types Q4_K,Q6_K,IQ4_NL,Q2_0 --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[rpw $r] /"
      env $e python3 bench/bench_mmvq.py --rows 4096 --k 14336 --types Q4_K,Q6_K,IQ4_NL,Q2_0 --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[rpw $r down] /"
    done
  done | tee $OUT/rpw.log
  ;;
s10e)  # Q4_K raw nibbles (high nibbles in place, scale / 16) on top of S10-1: MMVQ vs HEAD~ (.gl/base), interleaved; tests
  for v in new base new base; do
    python3 $(tree $v)/bench/bench_mmvq.py --types Q4_K,IQ3_S,IQ3_XXS,Q5_K --cols 1,4,8 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v big] /"
  done | tee $OUT/mmvq.log
  timeout 300 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_prefill.py tests/test_cuda_pdl.py \
      tests/test_cuda_decode_host.py tests/test_cuda_prefill_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20; true
  ;;
s10f)  # big packs: decode new vs base (B=1, 4); first half of the test model
  cp .models/tm.part1 /tmp/tm.part1
  synth_big
  decode_pairs "dense-8b dense-8b seed-moe-full" "new base"
  ;;
s10g)  # the test model joined: GPU tests with it; its decode new vs base
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared timeout 400 python3 -m pytest -q tests/test_cuda_vs_cpu.py \
      tests/test_cuda_backend.py tests/test_cuda_window.py tests/test_cuda_attention_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_env_knobs.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  decode_tm_vs() { for v in new base new base; do
    python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\| graphs \|" | sed "s/^/[$v] tm /"; done; }
  decode_tm_vs
  ;;
s10d)  # L2 prefetch of a warp's rows before the PDL wait: 0 / 8 KB / 32 KB, interleaved twice; both sizes
  for pass in 1 2; do
    for b in 0 8192 32768; do
      STRATA_MMVQ_L2_PREFETCH=$b python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[l2 $b] /"
      STRATA_MMVQ_L2_PREFETCH=$b python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[l2 $b big] /"
    done
  done | tee $OUT/l2.log
  ;;
s10c)  # IQ3 occupancy: one chunk per lane (TILE_MAX 600) with 3 or 2 stages, vs the default tiles; twice, interleaved
  for pass in 1 2; do
    for cfg in "" "STRATA_MMVQ_TILE_MAX=600" "STRATA_MMVQ_TILE_MAX=600 STRATA_MMVQ_IN_FLIGHT=1760"; do
      env $cfg python3 bench/bench_mmvq.py --types IQ3_S,IQ3_XXS,Q2_0 --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[${cfg:-default}] /"
      env $cfg python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[${cfg:-default} big] /"
    done
  done | tee $OUT/occ.log
  ;;
s10b)  # RAW sign decode on (1 column) / off / base, interleaved, both sizes
  for v in raw1 raw0 base raw1 raw0 base; do
    t=.; [ $v = base ] && t=.gl/base; r=${v#raw}; [ $v = base ] && r=1
    STRATA_MMVQ_SIGN_RAW=$r python3 $t/bench/bench_mmvq.py --types IQ3_S,IQ3_XXS,IQ2_XXS,IQ2_S --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
    STRATA_MMVQ_SIGN_RAW=$r python3 $t/bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,IQ3_XXS --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v big] /"
  done | tee $OUT/raw.log
  ;;
s10a)  # session 10: sign types decode RAW at one column, IQ3_S index by prmt, shared alignment: MMVQ vs HEAD (.gl/base); tests
  for v in new base new base; do
    python3 $(tree $v)/bench/bench_mmvq.py --types IQ3_S,IQ3_XXS,IQ2_XXS,IQ2_XS,IQ2_S,Q4_K --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
  done | tee $OUT/mmvq.log
  for v in new base; do
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,IQ3_XXS,Q4_K --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v big] /"
  done | tee -a $OUT/mmvq.log
  timeout 300 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_prefill.py tests/test_cuda_pdl.py \
      tests/test_cuda_decode_host.py tests/test_cuda_prefill_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s7a)  # session 7, first half of the test model; GPU tests of session 6's last mends (scheduler _forward, env_switch)
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_sample.py \
      tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s7b)  # round 1 (from the draft shipped then, session 4's): requests the target writes itself (greedy answers) + built-ins
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 -m strata mtp train --pack /tmp/tm.gguf --out $OUT/smollm2-135m-instruct.mtp.gguf --device cuda --trainer xp \
      --init strata/mtp/data/smollm2-135m-instruct.mtp.gguf --prompts 994 --answers 2 --self-prompts 20000 --max-new 256 \
      --slots 64 --data-minutes ${DATA_MIN:-4} --steps 40000 --train-minutes ${TRAIN_MIN:-3} --batch-tokens 4096 --lr 1e-3 \
      --eval-every 500 --seed 7 --data-cache /tmp/d7 2>&1 | tee $OUT/train.log | cut -c1-220 | grep -vE "step [0-9]*[1-9]0/|step [0-9]*[1-9]/"
  ;;
s7c)  # the retrained draft vs the shipped one: every held-out prompt, every --spec and min-p; batch-MTP at 2 and 4 slots
  drafts_vs_shipped "" "" "--specs 1,3 --batch-configs 1:0.0"
  ;;
s7d)  # the retrained draft: --spec 1-3 at 1 slot and batch-MTP --spec 1 / 2 at 2 and 4 slots, 128-token answers; the shipped one at --spec 1
  drafts_vs_shipped "--max-tokens 128" "--specs 1,2,3 --batch-configs 1:0.0,2:0.0" "--specs 1 --batch-configs 1:0.0"
  ;;
s7e)  # round 2: fresh requests and answers (seed 8), continuing from round 1's draft at a lower peak rate
  python3 -m strata mtp train --pack /tmp/tm.gguf --out $OUT/smollm2-135m-instruct.mtp.gguf --device cuda --trainer xp \
      --init .models/new.mtp.gguf --prompts 994 --answers 2 --self-prompts 20000 --max-new 256 \
      --slots 64 --data-minutes 4.5 --steps 40000 --train-minutes 3 --batch-tokens 4096 --lr 6e-4 \
      --eval-every 500 --seed 8 --data-cache /tmp/d8 2>&1 | tee $OUT/train.log | cut -c1-220 | grep -E "acceptance|wrote|data:.*(sequences|written by)|fit"
  ;;
s7f)  # round 2's draft: every --spec and min-p at 1 slot, batch-MTP --spec 1 / 2 at 2 and 4 slots, 128-token answers; the shipped one at --spec 1
  drafts_vs_shipped "--max-tokens 128" "--batch-configs 1:0.0,2:0.0" "--specs 1 --batch-configs 1:0.0"
  ;;
s6l)  # prefetch except the 4-bit lookup types, IQ grids free at 5-8 columns: tests; table vs HEAD (.gl/base2)
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_prefill.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head
  mmvq_vs "new head" $T6 1,2,4,8
  ;;
s6k)  # activation blocks loaded before the tile wait (1-2 columns) vs HEAD (.gl/base2), interleaved; mmvq tests
  python3 -m pytest -q tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head
  for v in new head new head; do
    d=$(tree $v)
    python3 $d/bench/bench_mmvq.py --types Q2_0,IQ4_NL,Q4_K,IQ3_S,Q8_0,Q4_1,Q6_K,Q2_K --cols 1,2 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
    python3 $d/bench/bench_mmvq.py --rows 1536 --k 576 --types Q4_1 --cols 1,2 2>&1 | grep -E "^ *Q" | sed "s/^/[$v] 1536x576 /"
  done | tee $OUT/pre.log
  ;;
s6j)  # 1-column occupancy: NARROW_MIN_BLOCKS (register cap) x TILE_MAX (600: one chunk per lane, smaller tiles)
  for rep in 1 2; do
    for cfg in "1 1408" "8 1408" "1 600" "8 600" "6 600"; do
      set -- $cfg
      STRATA_MMVQ_NARROW_MIN_BLOCKS=$1 STRATA_MMVQ_TILE_MAX=$2 python3 bench/bench_mmvq.py --types Q2_0,IQ4_NL,Q4_K,IQ3_S,Q8_0,Q4_1,Q6_K --cols 1 2>&1 \
          | grep -E "^ *(Q|I)" | sed "s/^/[mb$1 t$2] /"
    done
  done | tee $OUT/narrow.log
  ;;
s6h)  # final, first half: the MMVQ table, this tree vs session 5's kernels (.gl/base); keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  mmvq_vs "new base" $T6 1,4,8
  ;;
s6i)  # final, second half: every GPU test; decode of the test model, dense-8b and seed-moe-full vs session 5's kernels
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared python3 -m pytest -q -s tests/test_cuda_vs_cpu.py \
      tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py \
      tests/test_cuda_sample.py tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )|equal prefix|positions" $OUT/tests.log | head -20
  decode_vs_base "new base new base"
  ;;
s6g)  # many-column MMVQ held to 128 registers (WIDE_MIN_BLOCKS 4, spills on IQ grids at 8) vs free (1)
  for v in 4 1 4 1; do
    STRATA_MMVQ_WIDE_MIN_BLOCKS=$v python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,IQ3_XXS,IQ2_XS,Q2_K,Q4_1,Q5_K,IQ4_NL,Q2_0,Q6_K --cols 4,8 2>&1 \
        | grep -E "^ *(Q|I)" | sed "s/^/[mb$v] /"
  done | tee $OUT/wide.log
  ;;
s6f)  # final kernels: GPU tests that need no test model; MMVQ table this tree vs HEAD~ (.gl/base); tile 1200 vs 1408
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_backend.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  mmvq_vs "new base" $T6 1,4,8
  for v in t1200 t1408 t1200 t1408; do
    STRATA_MMVQ_TILE_MAX=${v#t} python3 bench/bench_mmvq.py --types Q4_1,Q5_0,Q5_K --cols 1,4 2>&1 | grep -E "^ *Q" | sed "s/^/[$v] /"
  done | tee $OUT/tile.log
  ;;
s6e)  # more chunks per lane per item (STRATA_MMVQ_TILE_MAX / CPL_MAX) on the types whose tiles still fit 48 KB
  for v in def wide def wide; do
    e=""; [ $v = wide ] && e="STRATA_MMVQ_TILE_MAX=2400 STRATA_MMVQ_CPL_MAX=4"
    env $e python3 bench/bench_mmvq.py --types Q4_1,Q2_0,Q1_0,Q2_K --cols 1,4 2>&1 | grep -E "^ *(Q|copy)" | sed "s/^/[$v] /"
  done | tee $OUT/wide.log
  ;;
s6d)  # the test model's matrix shapes at 1 / 4 / 8 columns, this tree vs HEAD's kernels, interleaved
  for v in new base new base; do
    d=$(tree $v)
    for shape in "576 576 Q4_1" "1536 576 Q4_1" "576 1536 Q4_1" "49152 576 Q8_0"; do
      set -- $shape
      python3 $d/bench/bench_mmvq.py --rows $1 --k $2 --types $3 --cols 1,4,8 2>&1 | grep -E "^ *$3 " | sed "s/^/[$v] $1x$2 /"
    done
  done | tee $OUT/small.log
  ;;
s6c)  # decode, this tree vs HEAD's kernels (.gl/base) interleaved: test model x2, then dense-8b and seed-moe-full
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf 2>/dev/null || true
  decode_vs_base "new base new base"
  ;;
s6a)  # MMVQ loads through LDS and shared alignment (this tree) vs HEAD's kernels (.gl/base, `git archive`) in one call
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_prefill.py tests/test_cuda_decode_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  T=Q4_K,IQ3_S,Q2_0,IQ4_NL,Q2_K,Q4_1,Q8_0,Q4_0,Q6_K,IQ3_XXS,MXFP4
  for v in base new base new; do
    d=$(tree $v)
    python3 $d/bench/bench_mmvq.py --types $T --cols 1,4 2>&1 | grep -vE "^strata" | sed "s/^/[$v] /" | tee -a $OUT/mmvq.log
  done | grep -E "copy|Q4_K|IQ3_S|Q2_0|IQ4_NL|Q2_K|Q4_1|Q8_0|Q4_0|Q6_K|IQ3_XXS|MXFP4"
  ;;
s6b)  # whole models on the GPU vs the CPU (test_cuda_vs_cpu), window tests; test model decode, this tree vs HEAD's
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared python3 -m pytest -q -s tests/test_cuda_vs_cpu.py \
      tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )|equal prefix|positions" $OUT/tests.log | head -20
  for v in new base; do
    d=$(tree $v)
    python3 $d/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\|" | sed "s/^/[$v] /"
  done
  ;;
s5n)  # batch-MTP against plain batching with 128 generated tokens per request (llama-batched-bench's ntg), all 18 held-out prompts
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 6 --repeats 3 --max-tokens 128 --only-batch \
      --batch-configs 1:0.0,1:0.5 > $OUT/mtp.log 2>&1
  grep -E "^\| [24] |greedy outputs|took" $OUT/mtp.log
  ;;
s5m)  # bench_mtp on every held-out prompt (6 chat, 4 of each other kind), median of 3 runs; batch-MTP --spec 1 at 2 and 4 slots
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 6 --repeats 3 --batch-configs 1:0.0 > $OUT/mtp.log 2>&1
  grep -E "\| all \||\| chat \||^1 slot|^\| [24] |greedy outputs|took" $OUT/mtp.log
  ;;
s5k)  # final: every GPU test (window, backend, mmvq, prefill, sample); the test model's decode vs llama.cpp
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py \
      tests/test_cuda_sample.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs,nosplit --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
      | tee $OUT/engine.log | grep -E "^\||equal"
  python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL,Q2_K,Q4_1,Q8_0 --cols 1,4,8 2>&1 | tee $OUT/mmvq.log | grep -vE "^strata"
  ;;
s5l)  # final: bench_mtp, every --spec and min-p at 1 slot, batch-MTP settings at 2 and 4 slots (median of 3 runs each)
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 --repeats 3 \
      --batch-configs 1:0.0,1:0.5,2:0.5 > $OUT/mtp.log 2>&1
  grep -E "\| all \||^1 slot|^\| [24] |greedy outputs|took" $OUT/mtp.log
  ;;
s5j)  # GPU time per window graph at 4 slots, plain vs batch-MTP (separate draft step, fused)
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for f in 0 1; do
    echo "[fused=$f]"; STRATA_MTP_FUSED=$f python3 bench/mtp_window_gpu_time.py --pack /tmp/tm.gguf --parallel 4
  done 2>&1 | tee $OUT/wintime4.log | grep -vE "^strata|^\[strata"
  ;;
s5i)  # MTP --spec 1 at 1/2/4 slots, separate draft step vs fused (the default), median of 5 runs each
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for f in 0 1; do
    STRATA_MTP_FUSED=$f python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 --specs 1 --repeats 5 \
        --batch-configs 1:0.0 2>&1 | tee $OUT/mtp$f.log | grep -E "\| all \||^1 slot|^\| [24] |greedy outputs|took" | sed "s/^/[fused=$f] /"
  done
  ;;
s5h)  # graph inputs in one copy; fused drafting by default: window/backend/sample tests; engine decode; MTP at 1/2/4 slots
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_sample.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
      | tee $OUT/engine.log | grep -E "^\||equal"
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 --specs 1 --batch-configs 1:0.0 2>&1 \
      | tee $OUT/mtp.log | grep -E "\| all \||^1 slot|^\| [24] |greedy outputs"
  ;;
s5g)  # host profile of plain batching vs batch-MTP (fused, the default now) at 4 slots
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/mtp_host_profile.py --pack /tmp/tm.gguf --spec 1 --parallel 4 --top 45 > $OUT/hostprof4.log 2>&1
  grep -E "^== " $OUT/hostprof4.log
  ;;
s5e)  # small matrices' columns in parallel (mmvq.split_columns): every kernel, sampling, backend and window test; window kernel profiles
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_sample.py tests/test_cuda_backend.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['smollm'], '/tmp/smollm', progress=lambda s: None)"
  for w in 1 2 4 8; do python3 bench/gpu_kernel_profile.py --pack /tmp/smollm --width $w --context 100; done > $OUT/kprof.log 2>&1
  grep -E "^pack|sum of|as one graph|mmvq" $OUT/kprof.log
  ;;
s5f)  # the test model: decode B=1..8 with and without split columns; MTP and batch-MTP (fused) at --spec 1
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs,nosplit --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
      | tee $OUT/engine.log | grep -E "^\||equal"
  for f in 1; do
    STRATA_MTP_FUSED=$f python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 --specs 1 \
        --batch-configs 1:0.0 2>&1 | grep -E "\| all \||^1 slot|^\| [24] |greedy outputs" | sed "s/^/[fused=$f] /"
  done | tee $OUT/fused.log
  ;;
s5d)  # argmax and top probability in one kernel: sampling and window tests, window GPU times, MTP with and without fusion
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 -m pytest -q tests/test_cuda_sample.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for f in 0 1; do
    echo "[fused=$f]"; STRATA_MTP_FUSED=$f python3 bench/mtp_window_gpu_time.py --pack /tmp/tm.gguf --parallel 1
  done 2>&1 | tee $OUT/wintime.log | grep -vE "^strata|^\[strata"
  for f in 0 1; do
    STRATA_MTP_FUSED=$f python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 --specs 1 \
        --batch-configs 1:0.0 2>&1 | grep -E "\| all \||^1 slot|^\| [24] |greedy outputs" | sed "s/^/[fused=$f] /"
  done | tee $OUT/fused.log
  ;;
s5c)  # GPU time of each window graph in a real MTP run, fused and not, at 1 and 2 slots
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for f in 0 1; do for n in 1 2; do
    echo "[fused=$f]"; STRATA_MTP_FUSED=$f python3 bench/mtp_window_gpu_time.py --pack /tmp/tm.gguf --parallel $n
  done; done 2>&1 | tee $OUT/wintime.log | grep -vE "^strata|^\[strata"
  ;;
s5b)  # where a fused MTP window's time goes: host profile at 1 and 2 slots; GPU time of 1- and 2-row windows
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for n in 1 2; do
    STRATA_MTP_FUSED=1 python3 bench/mtp_host_profile.py --pack /tmp/tm.gguf --spec 1 --parallel $n --top 30 > $OUT/hostprof$n.log 2>&1
    grep -E "^== " $OUT/hostprof$n.log
  done
  for w in 1 2 4; do python3 bench/gpu_kernel_profile.py --pack /tmp/tm.gguf --width $w --context 100; done > $OUT/kprof.log 2>&1
  grep -E "^pack|sum of|as one graph" $OUT/kprof.log
  ;;
s5a)  # fused drafting on the GPU: its window tests, then MTP with and without it on the test model
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 -m pytest -q tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for f in 0 1; do
    STRATA_MTP_FUSED=$f python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 --specs 1 \
        --batch-configs 1:0.0 2>&1 | grep -E "\| all \||^1 slot|^\| [24] |greedy outputs" | sed "s/^/[fused=$f] /"
  done | tee $OUT/fused.log
  ;;
s4k)  # final numbers on the test model: decode B=1..8 and pp512 vs llama.cpp; batch-MTP settings at 2 and 4 slots
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
      | tee $OUT/engine.log | grep -E "^\||equal"
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --only-batch --batch-configs 1:0.0,1:0.5,1:0.8,2:0.5,3:0.8 \
      > $OUT/batch.log 2>&1
  grep -E "^\| [24] |greedy outputs|bench took" $OUT/batch.log
  ;;
s4j)  # final: the prompt-path tests at the chosen tiles (256 rows, prompts >= 256), every window test; dense and seed-moe pp512
  python3 -m pytest -q tests/test_cuda_prefill.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('dense-8b', 'seed-moe-full'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  for p in dense-8b seed-moe-full; do
    python3 bench/bench_gpu_engine.py --pack /tmp/$p --modes graphs,mmvqprefill --batches 1 --tokens 16 --runs 3 2>&1 | grep -E "^\| (graphs|mmvq)|equal"
  done | tee $OUT/pp.log
  ;;
s4i)  # prompt GEMM row tiles 64 / 128 / 256 on dense-8b
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['dense-8b'], '/tmp/dense-8b', progress=lambda s: None)"
  python3 bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs,tile128,tile256 --batches 1 --tokens 16 --runs 3 \
      --ref 304,9872 2>&1 | tee $OUT/dense.log | grep -E "^\||equal"
  ;;
s4h)  # long prompts' rows through dequant + GEMM in fixed 64-row tiles (batch-invariant); every GPU test (final)
  python3 -m pytest -q tests/test_cuda_prefill.py tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py \
      tests/test_cuda_sample.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('dense-8b', 'seed-moe-full'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  python3 bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs,mmvqprefill --batches 1,4 --tokens 32 --runs 3 \
      --ref 304,743,9872 2>&1 | tee $OUT/dense.log | grep -E "^\||equal"
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs,mmvqprefill --batches 1,4 --tokens 32 --runs 3 \
      --ref 299,699,12487 2>&1 | tee $OUT/moe.log | grep -E "^\||equal"
  ;;
s4g)  # where a batch-MTP window's time goes (2 slots, --spec 1): smollm-shaped synthetic target + the shipped draft
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['smollm'], '/tmp/smollm', progress=lambda s: None)"
  for n in 1 2; do python3 bench/mtp_host_profile.py --pack /tmp/smollm --draft strata/mtp/data/smollm2-135m-instruct.mtp.gguf \
      --spec 1 --parallel $n --top 30; done > $OUT/prof.log 2>&1
  grep -E "^==|per token" $OUT/prof.log; cut -c1-150 $OUT/prof.log | grep -v "^$" | tail -75
  ;;
s4f)  # the trained draft (shipped now): the full MTP bench on the GPU, every --spec and min-p, batch-MTP at 2 and 4 slots
  [ -f /tmp/tm.gguf ] || cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 \
      --draft strata/mtp/data/smollm2-135m-instruct.mtp.gguf > $OUT/mtp.log 2>&1
  grep -E "\| all \||^1 slot|^\| [24] \||greedy outputs|bench took" $OUT/mtp.log
  ;;
s4d)  # the xp trainer on the GPU, smoke: a tiny synthetic llama target on the CUDA backend; keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  tiny=$(python3 -c "from tests.support.model_fixtures import synth_model; print(synth_model('/tmp/tiny', 'llama'))")
  python3 -m strata mtp train --pack $tiny --out /tmp/tiny.mtp.gguf --device cuda --trainer xp --steps 40 --prompts 16 \
      --answers 2 --max-new 24 --held-out-per-kind 1 --batch-tokens 1024 --train-minutes 0.1 --eval-every 20 2>&1 | tee $OUT/smoke.log
  ;;
s4e)  # train the shipped draft on the GPU: the test model writes ~1M tokens (6 answers per built-in prompt), the xp trainer on CuPy
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 -m strata mtp train --pack /tmp/tm.gguf --out $OUT/smollm2-135m-instruct.mtp.gguf --device cuda --trainer xp \
      --init strata/mtp/data/smollm2-135m-instruct.mtp.gguf --prompts 994 --answers 6 --max-new 256 --slots 128 \
      --data-minutes 3.5 --steps 4000 --train-minutes 2.5 --batch-tokens 4096 --lr 1e-3 --eval-every 200 --seed 4 \
      --data-cache /tmp/d4 2>&1 | tee $OUT/train.log | grep -v "answers, .* tokens generated" | cut -c1-220
  left=$((575 - SECONDS)); echo "bench_mtp --quick with ${left} s left"
  [ $left -gt 30 ] && timeout $left python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --quick \
      --draft $OUT/smollm2-135m-instruct.mtp.gguf > $OUT/mtp.log 2>&1
  grep -E "\| all \||^1 slot|^\| [24] \||greedy outputs|bench took" $OUT/mtp.log
  ;;
s4c)  # attention: one block per KV group's query heads (prefill); grouped experts at 4 blocks/SM; dense too
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('seed-moe-full', 'dense-8b'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  python3 bench/gpu_prefill_probe.py --pack /tmp/seed-moe-full 2>&1 | tee $OUT/probe.log | grep -E "^\| [a-z]|window"
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs,headblocks,gqadecode --batches 1,4 --tokens 32 --runs 3 \
      --ref 299,699,12487 2>&1 | tee $OUT/moe.log | grep -E "^\||equal"
  python3 bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs,headblocks --batches 1 --tokens 32 --runs 3 \
      --ref 304,9872 2>&1 | tee $OUT/dense.log | grep -E "^\||equal"
  ;;
s4b)  # float weights one launch per wide window; where a seed-moe prefill window's time goes
  python3 -m pytest -q tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  python3 bench/gpu_prefill_probe.py --pack /tmp/seed-moe-full 2>&1 | tee $OUT/probe.log | cut -c1-160 | grep -v "^$" | head -60
  ;;
s4a)  # session 4: every GPU test (grouped experts new; last session's tidy commit unrun); MoE prefill grouped vs not
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_sample.py tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs,ungrouped --batches 1,4 --tokens 32 --runs 3 \
      --ref 299,699,12487 2>&1 | tee $OUT/moe_prefill.log | grep -E "^\||equal|pp512"
  ;;
s3z)  # final: every GPU test on the final tree
  python3 -m pytest -q tests/test_cuda_sample.py tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s3l)  # sampled decoding on the test model (real logits): device vs host sampling
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for smp in "temperature=0.8,top_p=0.95" "temperature=0.7,min_p=0.05" "temperature=1.0,top_k=40"; do
    python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs,hostsample --tokens 64 --runs 2 --batches 1,4 \
        --sample "$smp" 2>&1 | tail -6 | grep -v "^|---"
  done | tee $OUT/sampling.log
  ;;
s3k)  # sampling on the device: kernel vs host sampler tests, window/backend tests, sampled decode speed
  python3 -m pytest -q tests/test_cuda_sample.py tests/test_cuda_window.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['smollm'], '/tmp/smollm', progress=lambda s: None)"
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs,hostsample --tokens 64 --runs 2 --batches 1,4 \
      --sample "temperature=0.8,top_p=0.95" 2>&1 | tail -6
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs,hostsample --tokens 64 --runs 2 --batches 1,4 \
      --sample "temperature=0.7,min_p=0.05" 2>&1 | tail -5
  ;;
s3j0)  # keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  ;;
s3j)  # host time of MTP windows (cProfile) on the test model
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/mtp_host_profile.py --pack /tmp/tm.gguf --spec 1 --top 28 > $OUT/hostprof.log 2>&1
  cut -c1-150 $OUT/hostprof.log | grep -v "^$"
  ;;
s3h)  # draft chains (k greedy draft steps in one graph): GPU window tests; keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s3i)  # the test model: MTP with draft chains on the GPU, every --spec and min-p, batch-MTP at 2 and 4 slots
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --per-kind 3 > $OUT/mtp.log 2>&1
  grep -E "\| all \||^1 slot|^\| [24] \||greedy outputs|bench took" $OUT/mtp.log
  ;;
s3g)  # final: every GPU test; per-kernel profiles of the three packs; MMVQ in-flight 4096 vs 3072
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py tests/test_mtp_defaults.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'seed-moe-full', 'dense-8b'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  for p in smollm seed-moe-full dense-8b; do python3 bench/gpu_kernel_profile.py --pack /tmp/$p --context 600; done > $OUT/kprofile.log 2>&1
  grep -E "^pack|sum of|as one graph" $OUT/kprofile.log
  for f in 3072 4096; do
    STRATA_MMVQ_IN_FLIGHT=$f python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1,4 2>&1 | tail -4 | sed "s/^/[$f] /"
  done | tee $OUT/mmvq.log
  ;;
s3e)  # MMVQ bandwidth (HBM-resident weights) at two in-flight depths; keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  for f in 3072 6144; do
    STRATA_MMVQ_IN_FLIGHT=$f python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL,Q4_1,Q8_0 --cols 1,4 2>&1 | tail -9 | sed "s/^/[$f] /"
  done | tee $OUT/mmvq.log
  python3 bench/bench_mmvq.py --rows 4096 --k 14336 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1,4 2>&1 | tail -7 | tee -a $OUT/mmvq.log
  ;;
s3f)  # the test model: engine bench vs llama.cpp, GPU vs CPU vs reference, MTP and batch-MTP on the GPU (warmed)
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --tokens 128 \
      --ref 945,1488,2598,4530,49000 2>&1 | tail -5 | tee $OUT/testmodel.log
  python3 bench/gpu_engine_check.py --model /tmp/tm.gguf --ref .models/smollm2-greedy.json 2>&1 | tail -12 | tee $OUT/check.log
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --quick --per-kind 2 > $OUT/mtp.log 2>&1
  tail -30 $OUT/mtp.log
  ;;
s3d)  # gate+up experts in one launch; norm back to v1; 8 loads in attention; dense-8b too
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'seed-moe-full', 'dense-8b'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  python3 bench/gpu_kernel_profile.py --pack /tmp/seed-moe-full --context 600 > $OUT/kprofile.log 2>&1
  grep -v "^|---" $OUT/kprofile.log | cut -c1-100 | head -8; grep -E "sum|graph" $OUT/kprofile.log
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs --tokens 64 --runs 2 --ref 945,1488,2598,4530,49000 2>&1 | tail -3
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs --tokens 64 --runs 2 --ref 299,475,699,920,12487 2>&1 | tail -3
  python3 bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs --tokens 64 --runs 2 --ref 304,507,743,1008,9872 2>&1 | tail -3
  ;;
s3c)  # round 2: 16 loads in flight in attention, rope loads before trig, route by warp reductions, norm in registers
  python3 -m pytest -q -x tests/test_cuda_window.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -3 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'seed-moe-full'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  (python3 bench/gpu_kernel_profile.py --pack /tmp/smollm --context 600
   python3 bench/gpu_kernel_profile.py --pack /tmp/seed-moe-full --context 600
   python3 bench/gpu_kernel_profile.py --pack /tmp/seed-moe-full --context 200 | grep -E "attention|rope|sum") > $OUT/kprofile.log 2>&1
  grep -v "^|---" $OUT/kprofile.log | cut -c1-100 | head -60
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs --tokens 64 --runs 2 --ref 945,1488,2598,4530,49000 2>&1 | tail -5
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs --tokens 64 --runs 2 --ref 299,475,699,920,12487 2>&1 | tail -5
  ;;
s3b)  # latency kernels (attention one key per thread + self-merge, rope a warp per head, route in registers)
  python3 -m pytest -q -x tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -3 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'seed-moe-full'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  for p in /tmp/smollm /tmp/seed-moe-full; do python3 bench/gpu_kernel_profile.py --pack $p; done > $OUT/kprofile.log 2>&1
  grep -v "^|---" $OUT/kprofile.log | cut -c1-100 | head -60
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs --tokens 64 --runs 2 --ref 945,1488,2598,4530,49000 2>&1 | tail -5
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs --tokens 64 --runs 2 --ref 299,475,699,920,12487 2>&1 | tail -5
  ;;
s3a)  # session 3 baseline: the graph/eager/fallback tests, op profiles of smollm-shaped and seed-moe-full packs
  python3 -m pytest -q -x tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -3 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'seed-moe-full'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  for p in /tmp/smollm /tmp/seed-moe-full; do python3 bench/gpu_step_profile.py --pack $p --steps 32; done > $OUT/profile.log 2>&1
  grep -v "^|---" $OUT/profile.log | cut -c1-90
  ;;
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
e)  # GPU tests; keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -4 $OUT/tests.log
  ;;
f)  # the test model: losslessness of MTP / batching on the GPU, GPU vs CPU, engine bench
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --quick --per-kind 2 2>&1 | tee $OUT/mtp.log
  python3 bench/gpu_engine_check.py --model /tmp/tm.gguf --ref .models/smollm2-greedy.json 2>&1 | tail -12 | tee $OUT/check.log
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --tokens 128 \
      --ref 945,1488,2598,4530,49000 2>&1 | tail -6 | tee $OUT/testmodel.log
  ;;
g)  # prefill probe on a smollm-shaped synthetic pack
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['smollm'], '/tmp/smollm', progress=lambda s: None)"
  python3 bench/gpu_prefill_probe.py --pack /tmp/smollm 2>&1 | tee $OUT/probe.log
  ;;
h)  # GPU tests, prefill probe and engine bench on smollm-shaped and dense-8b synthetic packs
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -2 $OUT/tests.log
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'dense-8b'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  python3 bench/gpu_prefill_probe.py --pack /tmp/smollm 2>&1 | grep "STRATA_CUDA_PREFILL" | tee $OUT/probe.log
  python3 bench/bench_gpu_engine.py --pack /tmp/smollm --modes graphs --tokens 64 --runs 2 --ref 945,1488,2598,4530,49000 2>&1 | tail -5 | tee $OUT/smollm.log
  python3 bench/bench_gpu_engine.py --pack /tmp/dense-8b --modes graphs --tokens 64 --runs 2 --ref 304,507,743,1008,9872 2>&1 | tail -5 | tee $OUT/dense.log
  ;;
z1)  # final: every GPU test; keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -4 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
z2)  # final: MTP and losslessness on the GPU, the test model and seed-moe-full benchmarks
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --quick --per-kind 2 2>&1 | tee $OUT/mtp.log | tail -16
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --tokens 128 \
      --ref 945,1488,2598,4530,49000 2>&1 | tail -5 | tee $OUT/testmodel.log
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs --tokens 64 --runs 2 \
      --ref 299,475,699,920,12487 2>&1 | tail -5 | tee $OUT/seedmoe.log
  ;;
c)  # the seed-moe-full pack synthesized and benchmarked; keeps the test model's first half
  cp .models/tm.part1 /tmp/tm.part1
  python3 -c "import time; t=time.time(); from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None); print('seed-moe-full synthesized in %.0f s' % (time.time()-t))"
  python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes graphs --tokens 64 --runs 2 \
      --ref 299,475,699,920,12487 2>&1 | tee $OUT/seedmoe.log
  ;;
d)  # the test model: engine bench, GPU vs CPU vs llama.cpp, MTP with the shipped draft on the GPU
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs,eager --tokens 128 \
      --ref 945,1488,2598,4530,49000 2>&1 | tee $OUT/testmodel.log
  python3 bench/gpu_engine_check.py --model /tmp/tm.gguf --ref .models/smollm2-greedy.json 2>&1 | tail -12 | tee $OUT/check.log
  python3 bench/bench_mtp.py --pack /tmp/tm.gguf --device cuda --quick --per-kind 2 2>&1 | tee $OUT/mtp.log
  ;;
s8a)  # session 8: leaner MMVQ streaming, one-scale dot, pair-order lookups; vs the tree before (.gl/base2)
  python3 -m pytest -q tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  mmvq_vs "head new" Q4_K,IQ3_S,Q2_0,IQ4_NL,IQ3_XXS,Q8_0,Q4_0 1,4
  for v in head new; do
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 \
        | grep -vE "^strata" | sed "s/^/[$v big] /"
  done | tee -a $OUT/mmvq.log
  ;;
s8b)  # aligned-row instances, transposed warp sums; vs session start (base) and S8-3 (head)
  python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_backend.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  mmvq_vs "head new" Q4_K,IQ3_S,Q2_0,IQ4_NL,IQ3_XXS,Q8_0,Q4_0,Q6_K 1,2,4,8
  for v in base new; do
    python3 $(tree $v)/bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 \
        | grep -vE "^strata" | sed "s/^/[$v big] /"
  done | tee -a $OUT/mmvq.log
  ;;
s8c)  # first half of the test model; GPU tests without it; dense-8b and seed-moe-full decode, session 8 vs session start
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_prefill.py tests/test_cuda_sample.py tests/test_cuda_env_knobs.py \
      tests/test_cuda_decode_host.py tests/test_cuda_prefill_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  big_decode "new base"
  ;;
s8d)  # the test model joined: its GPU tests (window, GPU vs CPU) and decode, session 8 vs session start
  tm_joined_tests_decode
  ;;
s8e)  # long prompts' attention on tensor cores: its tests, then pp512 with it on and off (STRATA_CUDA_PROMPT_ATTENTION)
  python3 -m pytest -q tests/test_cuda_attention_prefill.py tests/test_cuda_window.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  synth_big
  for p in dense-8b seed-moe-full; do
    for on in 1 0; do
      STRATA_CUDA_PROMPT_ATTENTION=$on python3 bench/bench_gpu_engine.py --pack /tmp/$p --modes graphs --batches 1 --tokens 16 --runs 3 2>&1 \
          | tee -a $OUT/big.log | grep -E "^\| graphs \|" | sed "s/^/[prompt-attention=$on] $p /"
    done
  done
  ;;
s9a)  # session 9: PDL (programmatic dependent launch) in captured graphs; first half of the test model
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_mmvq.py tests/test_cuda_attention_prefill.py \
      tests/test_cuda_prefill.py tests/test_cuda_sample.py tests/test_cuda_env_knobs.py tests/test_cuda_decode_host.py \
      tests/test_cuda_prefill_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in 1 0 1 0; do
    STRATA_CUDA_PDL=$v python3 bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL,Q4_1 --cols 1,4 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[pdl$v] /"
  done | tee $OUT/pdl.log
  for v in 1 0; do
    STRATA_CUDA_PDL=$v python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[pdl$v big] /"
  done | tee -a $OUT/pdl.log
  for r in 8 16; do
    STRATA_MMVQ_ROWS_PER_WARP=$r python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[rpw$r big] /"
  done | tee -a $OUT/pdl.log
  ;;
s9e)  # fused kernels and the quantizer PDL-launched too (wait first, no __restrict__ / __ldg): tests; big packs PDL on / off
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_window.py tests/test_cuda_mmvq.py tests/test_cuda_prefill.py \
      tests/test_cuda_attention_prefill.py tests/test_cuda_sample.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  grep -qE "^FAILED" $OUT/tests.log && exit 1
  synth_big
  pdl_decode_big
  ;;
s9f)  # the test model joined: its GPU tests; decode PDL on / off, interleaved
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared python3 -m pytest -q tests/test_cuda_vs_cpu.py \
      tests/test_cuda_backend.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  pdl_decode_tm
  ;;
s9d)  # final tree: the GPU tests s9c / s9b did not run on it; the large-matrix MMVQ row, PDL on
  python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_attention_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_env_knobs.py tests/test_cuda_decode_host.py tests/test_cuda_prefill_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 bench/bench_mmvq.py --rows 57344 --k 8192 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I|device)" | tee $OUT/big.log
  ;;
s9c)  # expert ids and activations read from L2 (__ldcg) after the PDL wait: tests; MMVQ vs HEAD's __ldg (.gl/base), PDL on
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_mmvq.py tests/test_cuda_window.py tests/test_cuda_prefill.py \
      > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  for v in new base new base; do
    python3 $(tree $v)/bench/bench_mmvq.py --types Q4_K,IQ3_S,Q2_0,IQ4_NL,Q4_1 --cols 1,4,8 2>&1 | grep -E "^ *(Q|I)" | sed "s/^/[$v] /"
  done | tee $OUT/cg.log
  ;;
s9b)  # the test model joined: GPU tests that need it (graphs now with PDL); decode with PDL on / off; big packs too
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared python3 -m pytest -q tests/test_cuda_window.py \
      tests/test_cuda_vs_cpu.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  pdl_decode_tm
  synth_big
  pdl_decode_big
  ;;
s8f)  # final: first half of the test model; every GPU test that does not need it
  cp .models/tm.part1 /tmp/tm.part1
  python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_attention_prefill.py tests/test_cuda_prefill.py \
      tests/test_cuda_sample.py tests/test_cuda_env_knobs.py tests/test_cuda_decode_host.py tests/test_cuda_prefill_host.py \
      > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s8g)  # final: the test model joined; the tests that need it, and its decode and pp512
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared python3 -m pytest -q tests/test_cuda_window.py \
      tests/test_cuda_vs_cpu.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  python3 bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --runs 3 --ref 945,1488,2598,4530,49000 2>&1 \
      | tee -a $OUT/engine.log | grep -E "^\| (graphs|ratio|llama)" | sed "s/^/[final] tm /"
  ;;
s19d)  # the merged tree: every MMVQ test (chunk_acc now calls chunk_float, which mmq_grouped shares); the
       # one-column MMVQ of the issue's four types new vs session start
  timeout 330 python3 -m pytest -q tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  mmvq_vs "new base" Q4_K,IQ3_S,Q2_0,IQ4_NL 1
  ;;
s19g)  # the final tree: the test model's first half to /tmp (s19h joins it); the GPU test files s19a-s19d did not run
  cp .models/tm.part1 /tmp/tm.part1
  timeout 300 python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_prefill.py tests/test_cuda_sample.py tests/test_cuda_env_knobs.py \
      tests/test_cuda_decode_host.py tests/test_cuda_launch_layout.py tests/test_cuda_prefill_host.py tests/test_cuda_attention_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s19h)  # the test model joined: GPU vs CPU (test model, and seed-moe batch-MTP on the GPU vs plain on the CPU), backend
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf timeout 280 python3 -m pytest -q tests/test_cuda_vs_cpu.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s20m)  # the draft test after the other memory tests, gc.collect() before the partial draft's memory goes back
  timeout 100 python3 -m pytest -q tests/test_cuda_memory.py 2>&1 | tail -3
  ;;
s20l)  # the memory tests after other GPU tests in the same process (their pool's free blocks): S20-12
  timeout 300 python3 -m pytest -q tests/test_cuda_backend.py tests/test_cuda_window.py -k "not replay" tests/test_cuda_memory.py \
      > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|ERROR|E   )" $OUT/tests.log | head -20
  ;;
s20j)  # the final tree: the test model's first half to /tmp, the GPU test files not run since the change
  cp .models/tm.part1 /tmp/tm.part1
  timeout 400 python3 -m pytest -q tests/test_cuda_pdl.py tests/test_cuda_prefill.py tests/test_cuda_sample.py \
      tests/test_cuda_launch_layout.py tests/test_cuda_prefill_host.py tests/test_cuda_attention_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|ERROR|E   )" $OUT/tests.log | head -20
  ;;
s20k)  # the test model joined: GPU vs CPU (with the reference outputs), backend, window, memory
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_TEST_MODEL=/tmp/tm.gguf STRATA_SHARED=$PWD/.models/shared timeout 500 python3 -m pytest -q tests/test_cuda_vs_cpu.py \
      tests/test_cuda_backend.py tests/test_cuda_memory.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|ERROR|E   )" $OUT/tests.log | head -20
  ;;
s20i)  # a device that loses its context (a real trap in a child process): device_lost, on_fatal; the memory tests
  timeout 300 python3 -m pytest -q tests/test_cuda_memory.py 2>&1 | tail -15
  ;;
s20h)  # an MTP draft without room beside the model (MTP off, its partial uploads dropped), with the other memory tests
  timeout 300 python3 -m pytest -q tests/test_cuda_memory.py 2>&1 | tail -15
  ;;
s20g)  # backend selection by compute capability (sm_80 floor): its tests with a GPU, the kernels table, a GPU
       # test module that builds the table through the backend
  timeout 200 python3 -m pytest -q tests/test_backend_select.py tests/test_probe.py tests/test_cuda_env_knobs.py 2>&1 | tail -3
  python3 -m strata.cli.main kernels 2>&1 | head -5
  ;;
s20f)  # the out-of-memory GPU tests again (the child-process test's label fixed), and decode new vs the
       # session start (.gl/base = e3aaf98): the window path now grows caches before the window and checks a
       # cache's generation
  timeout 200 python3 -m pytest -q tests/test_cuda_memory.py 2>&1 | tail -3
  synth_big
  decode_pairs "seed-moe-full dense-8b" "new base"
  ;;
s20e)  # out of GPU memory: the new tests (pool limits, a child process), then the GPU tests of what the change
       # touches (the KV cache's table rebuilt by generation, free_bytes with the pool): window, backend, host tests
  timeout 200 python3 -m pytest -q tests/test_cuda_memory.py 2>&1 | tail -15
  timeout 380 python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_backend.py tests/test_cuda_decode_host.py \
      tests/test_cuda_env_knobs.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|ERROR|E   )" $OUT/tests.log | head -20
  ;;
s20d)  # the wait's own latency: chains of launches with nothing to do, and 16.5 MB of w6, each waiting by
       # griddepcontrol.wait (early, late) or by its predecessor's blocks' done-counter (flag)
  timeout 100 python3 bench/trace_launch_chain.py --tiny 2>&1 | tee $OUT/tiny.log | grep -E "tiny|per launch"
  timeout 150 python3 bench/trace_launch_chain.py --mb 16.5 --work 6,0 2>&1 | tee $OUT/trace16.log | grep -E "MB|per launch"
  grep -A12 "work 6, flag" $OUT/trace16.log
  ;;
s20c)  # the same timeline for launches of one to eight blocks an SM (fewer, larger blocks: the next launch's blocks
       # spread over the SMs instead of piling onto those that free first)
  timeout 200 python3 bench/trace_launch_chain.py --share 4096 --work 6 --shapes 4x8,8x4,16x2,32x1,4x7,8x3 2>&1 | tee $OUT/shapes.log \
      | grep -E "MB|per launch"
  ;;
s20b)  # the timeline of a PDL chain of tiles-shaped launches (bench/trace_launch_chain.py), 16.5 and 33 MB
  timeout 200 python3 bench/trace_launch_chain.py --mb 16.5 --work 6,0 2>&1 | tee $OUT/trace16.log
  timeout 100 python3 bench/trace_launch_chain.py --mb 33.0 --work 6 2>&1 | tee $OUT/trace33.log | tail -40
  ;;
s20a)  # probe: the launch ceiling's tiles_seq rows (a copying warp fetching pieces in order, the folding warps
       # starting on each as it lands) against w6's shape, at share 4096 (pieces of 512-byte multiples) and 4608
  timeout 200 python3 bench/bench_launch_ceiling.py --mb 16.5,25.2,33.0 --share 4096 2>&1 | tee $OUT/ceiling4096.log
  timeout 120 python3 bench/bench_mmvq.py --rows 14336 --k 4096 --types Q4_K,IQ3_S,Q2_0,IQ4_NL --cols 1 2>&1 | grep -E "^ *(Q|I|c)|rror|copy"
  ;;
s19k)  # review mend: the two grouped experts wrappers share their checks (_grouped_call): MMQ / plan / grouped
       # tests, the window tests that run them through the backend, bench_mmq once
  timeout 150 python3 -m pytest -q tests/test_cuda_mmvq.py -k "mmq or plan or grouped or experts" 2>&1 | tail -1
  prompt_window_tests
  timeout 120 python3 bench/bench_mmq.py 2>&1 | grep -E "^\| (gate|up|down)"
  ;;
s19j)  # Nsight Compute: the 32-column mmq_grouped<IQ3_S> at seed-moe's gate (bench_mmq's first row), as s18g
  timeout 200 ncu --clock-control none -k regex:mmq_grouped -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 bench/bench_mmq.py --runs 1 > $OUT/ncu_mmq.txt 2>&1
  grep -E "Duration|Throughput|Warp Cycles Per Issued|Issued Warp|Eligible|Active Warps|Achieved Occupancy|Theoretical Occ|Block Limit|Registers|No Eligible|Dynamic Shared|L1/TEX Hit|Bank|Pipe" $OUT/ncu_mmq.txt | head -50
  ;;
s19i)  # s19h's three skipped tests (the reference outputs under shared/, carried in .models/shared), test model joined
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  STRATA_SHARED=$PWD/.models/shared STRATA_TEST_MODEL=/tmp/tm.gguf timeout 280 python3 -m pytest -q -rs tests/test_cuda_vs_cpu.py > $OUT/tests.log 2>&1
  tail -3 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s19f)  # seed-moe-full decode again, new vs session start interleaved three times (s19e: B=1 427.5 / 466.3)
  decode_pairs seed-moe-full "new base new base new base"
  ;;
s19e)  # decode B=1 / B=4 (and pp512) of dense-8b and seed-moe-full, new vs session start
  synth_big
  big_decode "new base"
  ;;
s19c)  # wide windows with grouped experts graphed (their plan is one kernel): the plan / MMQ tests, every window
       # test; seed-moe-full pp512 new vs session start, twice interleaved
  timeout 120 python3 -m pytest -q tests/test_cuda_mmvq.py -k "mmq or plan or grouped" 2>&1 | tail -1
  timeout 330 python3 -m pytest -q tests/test_cuda_window.py > $OUT/tests_window.log 2>&1
  tail -1 $OUT/tests_window.log; grep -E "^(FAILED|E   )|capture of" $OUT/tests_window.log | head -20
  pp512_vs seed-moe-full "new base new base"
  ;;
s19b)  # the same tree: the window tests (prompt experts through mmq_grouped on the qwen3moe pack), the free-memory
       # guard test; seed-moe-full pp512 new vs session start, twice interleaved
  prompt_window_tests
  timeout 120 python3 -m pytest -q -rs tests/test_cuda_window.py -k "memory_is_short" 2>&1 | tail -2
  pp512_vs seed-moe-full "new base new base"
  ;;
s19a)  # mmq_grouped with 32-column tiles and cp.async double buffers: MMQ and plan tests, session 18's untested
       # free-memory guard test; bench_mmq at seed-moe's shapes; seed-moe-full pp512 new vs session start
  timeout 200 python3 -m pytest -q tests/test_cuda_mmvq.py -k "mmq or plan or grouped" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  timeout 120 python3 -m pytest -q tests/test_cuda_window.py -k "memory_is_short" 2>&1 | tail -1
  timeout 120 python3 bench/bench_mmq.py 2>&1 | tee $OUT/mmq.log | grep -v "^  File\|^    "
  pp512_vs seed-moe-full "new base"
  ;;
s18l)  # the grouped MoE kernel with 8 codebook copies for the IQ3 types (GROUP_BANKS, removed after the run: S18-11): grouped tests with it;
       # bench_experts_grouped (now bench_mmq.py) off / on, three rounds
  STRATA_MMVQ_GROUP_BANKS=1 timeout 150 python3 -m pytest -q tests/test_cuda_mmvq.py -k "grouped" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  for r in 1 2 3; do for gb in 0 1; do
    STRATA_MMVQ_GROUP_BANKS=$gb timeout 60 python3 bench/bench_mmq.py 2>&1 | grep -E "^\| (gate|up|down)" | tr '\n' ' ' | sed "s/^/[banks $gb] /"; echo
  done; done
  ;;
s18k)  # the test model's decode at B=4 and B=8: new / new with wide graphs off / session start, three rounds
  for r in 1 2 3; do for v in new new0 base; do
    e=STRATA_X=1; [ $v = new0 ] && e=STRATA_CUDA_WIDE_GRAPH_TOKENS=0
    env $e timeout 100 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --batches 4,8 --tokens 64 --runs 5 --prompt 64 2>&1 \
        | grep -E "B=[48]:" | tr '\n' ' ' | sed "s/^/[$v] tm /"; echo
  done; done
  ;;
s18i)  # the test model's first half to /tmp (s18j joins it)
  cp .models/tm.part1 /tmp/tm.part1; ls -la /tmp/tm.part1
  ;;
s18j)  # the final tree on the test model: decode B=1/2/4/8 and pp512 new vs session start, interleaved twice
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for v in new base new base; do
    timeout 100 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --tokens 64 --runs 3 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\| graphs \|" | sed "s/^/[$v] tm /"
  done
  ;;
s18h)  # the final tree (main): every GPU test file the session's changes touch, and the window tests in the
       # order whose capture failed in s18e (GC now off during captures)
  timeout 420 python3 -m pytest -q tests/test_cuda_window.py tests/test_cuda_prefill.py tests/test_cuda_attention_prefill.py \
      tests/test_cuda_env_knobs.py tests/test_cuda_backend.py tests/test_cuda_prefill_host.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )|capture of" $OUT/tests.log | head -20
  prompt_window_tests 150
  ;;
s18g)  # [ran on branch mmq-experiment, whose bench_mmq.py and mmq tests main lacks] Nsight Compute: mmq_grouped<IQ3_S> against mmvq_grouped<IQ3_S> at seed-moe's gate (bench_mmq's first row)
  for kn in mmq_grouped mmvq_grouped; do
    timeout 200 ncu --clock-control none -k regex:$kn -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 bench/bench_mmq.py --runs 1 > $OUT/ncu_$kn.txt 2>&1
    grep -E "Duration|Throughput|Warp Cycles Per Issued|Issued Warp|Eligible|Active Warps|Achieved Occupancy|Theoretical Occ|Block Limit|Registers|Stall|No Eligible|One or More|Shared Memory Configuration|Dynamic Shared|L1/TEX Hit|L2 Hit|Bank" $OUT/ncu_$kn.txt | head -60 | sed "s/^/[$kn] /"
  done
  ;;
s18f)  # [ran on branch mmq-experiment, whose bench_mmq.py and mmq tests main lacks] mmq_grouped staging its weight blocks through shared memory; the capture with GC off: MMQ tests,
       # bench_mmq, the window tests of s18e; seed-moe-full pp512 new vs session start
  timeout 200 python3 -m pytest -q tests/test_cuda_mmvq.py -k "mmq or grouped" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  timeout 120 python3 bench/bench_mmq.py 2>&1 | tee $OUT/mmq.log | grep -v "^Traceback\|^  File\|^    "
  prompt_window_tests
  pp512_vs seed-moe-full "new base"
  ;;
s18e)  # [ran on branch mmq-experiment, whose bench_mmq.py and mmq tests main lacks] prompt experts on int8 tensor cores (mmq_grouped): the MMVQ tests (chunk_acc refactored) and the MMQ
       # test; bench_mmq at seed-moe's shapes; window tests; seed-moe-full pp512 new vs session start
  timeout 300 python3 -m pytest -q tests/test_cuda_mmvq.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  timeout 120 python3 bench/bench_mmq.py 2>&1 | tee $OUT/mmq.log
  prompt_window_tests
  pp512_vs seed-moe-full "new base"
  ;;
s18d)  # prompt GEMMs on Strata's own cuBLAS handle (capturable): prefill and window tests; dense-8b pp512 new vs
       # session start (.gl/base), twice interleaved
  timeout 250 python3 -m pytest -q tests/test_cuda_prefill.py tests/test_cuda_window.py -k "not batch_mtp and not draft" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  pp512_vs dense-8b "new base new base"
  ;;
s18c)  # the test model's decode at B=1, 128 tokens: new / new with wide graphs off / session start, three rounds
  for r in 1 2 3; do for v in new new0 base; do
    e=STRATA_X=1; [ $v = new0 ] && e=STRATA_CUDA_WIDE_GRAPH_TOKENS=0
    env $e timeout 100 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --batches 1 --tokens 128 --runs 5 --prompt 64 2>&1 \
        | grep -E "B=1:" | sed "s/^/[$v] tm /"
  done; done
  ;;
s18a)  # wide windows graphed (prompt chunks on a shape's second sighting): attention and window tests; the
       # SmolLM2-shaped pack's pp512 new vs session start (.gl/base); the test model's first half to /tmp
  cp .models/tm.part1 /tmp/tm.part1
  timeout 280 python3 -m pytest -q tests/test_cuda_attention_prefill.py tests/test_cuda_window.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  pp512_vs smollm "new base new base"
  ;;
s18b)  # the test model joined: pp512 (and decode) new vs session start, twice; its GPU tests
  cat /tmp/tm.part1 .models/tm.part2 > /tmp/tm.gguf
  for v in new base new base; do
    timeout 100 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/tm.gguf --modes graphs --batches 1,4 --tokens 32 --runs 3 2>&1 \
        | tee -a $OUT/engine.log | grep -E "^\| graphs \||captured" | sed "s/^/[$v] tm /"
  done
  STRATA_TEST_MODEL=/tmp/tm.gguf timeout 200 python3 -m pytest -q tests/test_cuda_vs_cpu.py tests/test_cuda_backend.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -20
  ;;
s17g)  # final tree (a5e2951): the GPU test files the session's other runs did not take whole
  timeout 220 python3 -m pytest -q -x tests/test_cuda_pdl.py tests/test_cuda_env_knobs.py tests/test_cuda_backend.py \
      tests/test_cuda_launch_layout.py tests/test_cuda_sample.py tests/test_cuda_attention_prefill.py tests/test_cuda_prefill.py > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  ;;
s17f)  # final tree: prefill activations cast by one kernel (dequant.to_f16); GPU tests; dense-8b probe; pp512 new vs .gl/base
  timeout 240 python3 -m pytest -q tests/test_cuda_prefill.py tests/test_cuda_prefill_host.py tests/test_cuda_mmvq.py tests/test_cuda_window.py \
      -k "prefill or 42 or Q2_0 or grouped or plan or experts or long_prompt or invariance" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  synth_big
  timeout 100 python3 bench/gpu_prefill_probe.py --pack /tmp/dense-8b 2>&1 | tee $OUT/prefill_dense.log | grep -E "window|function calls|total of"
  for pk in dense-8b seed-moe-full; do for v in new base; do
    timeout 90 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/$pk --modes eager --batches 1 --tokens 8 --runs 2 2>&1 \
        | grep -E "pp512:" | sed "s/^/[$v] $pk /"
  done; done
  ;;
s17e)  # 91de5e8: its Q2_0 / plan / grouped / window tests; the prefill probe on the llama packs (smollm, dense-8b)
  timeout 200 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_window.py \
      -k "42 or Q2_0 or grouped or plan or experts or long_prompt or invariance" > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
for n in ('smollm', 'dense-8b'): synth_pack(PRESETS[n], '/tmp/' + n, progress=lambda s: None)"
  for pk in smollm dense-8b; do
    timeout 150 python3 bench/gpu_prefill_probe.py --pack /tmp/$pk 2>&1 | tee $OUT/prefill_$pk.log | grep -v "^ *$" | grep -v "^---\|^|---" | head -60 | sed "s/^/[$pk] /"
  done
  ;;
s17d)  # the experts' plan in one kernel and the sorted activations gathered once: tests; seed-moe-full prefill new vs .gl/base
  timeout 200 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_window.py -k "grouped or plan or experts or long_prompt or invariance" \
      > $OUT/tests.log 2>&1
  tail -1 $OUT/tests.log; grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  timeout 200 python3 bench/gpu_prefill_probe.py --pack /tmp/seed-moe-full 2>&1 | tee $OUT/prefill.log | grep -E "window|function calls|experts|attention|total" | head -30
  for v in new base new base; do
    timeout 120 python3 $(tree $v)/bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes eager --batches 1 --tokens 8 --runs 3 2>&1 \
        | grep -E "pp512:" | sed "s/^/[$v] /"
  done
  ;;
s17c)  # seed-moe-full's 512-token prefill: per-op GPU time with the long-prompt path off / on; pp512 of the engine off / on
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  timeout 300 python3 bench/gpu_prefill_probe.py --pack /tmp/seed-moe-full 2>&1 | tee $OUT/prefill.log | grep -v "^ *$" | head -90
  for v in 1 0; do
    STRATA_CUDA_PREFILL=$v timeout 150 python3 bench/bench_gpu_engine.py --pack /tmp/seed-moe-full --modes eager --batches 1 --tokens 8 --runs 3 2>&1 \
        | grep -E "pp512:" | sed "s/^/[PREFILL=$v] /"
  done
  ;;
s17b)  # RAW_PLANES: the MMVQ and PDL tests; where seed-moe-full's 512-token prefill window spends its time
  timeout 300 python3 -m pytest -q tests/test_cuda_mmvq.py tests/test_cuda_pdl.py > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log
  grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  python3 -c "from strata.pack.presets import PRESETS; from strata.pack.synth import synth_pack
synth_pack(PRESETS['seed-moe-full'], '/tmp/seed-moe-full', progress=lambda s: None)"
  timeout 240 python3 bench/gpu_prefill_probe.py --pack /tmp/seed-moe-full 2>&1 | tee $OUT/prefill.log | grep -v "^ *$" | head -70
  ;;
s17a)  # Q2_0 RAW_PLANES (masks, no shifts) vs HEAD (.gl/base); the activation permutes' cost (PROBE_NO_ORDER: timing only;
       # that knob, a `return` at the top of activation_order, was removed after the run: S17-1)
  python3 -m pytest -q tests/test_cuda_mmvq.py -k "42 or Q2_0" > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log
  grep -E "^(FAILED|E   )" $OUT/tests.log | head -10
  for v in base new; do
    python3 $(tree $v)/bench/sass_mmvq.py --out $OUT/sass_$v 'mmvq<42, 1, true>' 'mmvq<42, 4>' 'mmvq<20, 1, true, 4, true>' 2>&1 | sed "s/^/[$v] /"
  done
  python3 bench/sass_mmvq.py --out $OUT/sass_probe -D PROBE_NO_ORDER=1 'mmvq<42, 1, true>' 'mmvq<42, 4>' 'mmvq<20, 1, true, 4, true>' 2>&1 | sed "s/^/[probe] /"
  for v in base new probe base new probe; do
    e=STRATA_X=1; [ $v = probe ] && e=STRATA_MMVQ_PROBE_NO_ORDER=1
    env $e python3 $(tree $v)/bench/bench_mmvq.py --types Q2_0,IQ4_NL,Q4_K,IQ3_S --cols 1,2,4,8 2>&1 | grep -E "^(Q|I)|^device|rror" | sed "s/^/[$v] /"
  done | tee $OUT/mmvq.log
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
