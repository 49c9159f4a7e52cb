export STRATA_TOKENIZER_GGUF=$PWD/.models/tokenizer.gguf PYTHONPATH=$PWD
T="tests/test_cuda_window.py::test_window_graphs_replay_eager_bits tests/test_cuda_window.py::test_batch_invariance"
for cfg in "X=1" "STRATA_DIAG_NOTRIGGER=1" "STRATA_DIAG_IDS_CG=1" "STRATA_DIAG_ALL_CG=1" "STRATA_DIAG_NOTRIGGER_MMVQ=1" "STRATA_DIAG_NOTRIGGER=1 STRATA_DIAG_NOTRIGGER_MMVQ=1"; do
  echo "== $cfg"
  env $cfg python3 -m pytest -q $T -k "qwen3moe and f16" 2>&1 | tail -1
done
