export STRATA_TOKENIZER_GGUF=$PWD/.models/tokenizer.gguf
T="tests/test_cuda_window.py::test_window_graphs_replay_eager_bits tests/test_cuda_window.py::test_batch_invariance"
for cfg in "" ; do
  echo "== skip [$cfg]"
  STRATA_CUDA_PDL_SKIP="$cfg" python3 -m pytest -q -x $T -k qwen3moe 2>&1 | tail -1
done
python3 - <<'PY'
import cupy as cp
from strata.kernels.cuda import mmvq as gpu
f = gpu._named_function("mmvq_ids_pair<21, 18, true>")
print("name attr:", getattr(f, "name", None))
PY
python3 bench/diag_pdl.py
