#!/usr/bin/env bash
# fp8-delayed with Transformer Engine's scale semantics (a stored scale per operand, so the casts of
# BF16 activations and gradients run inside the kernels that produce them) against main's fp8-delayed,
# on one GPU in one call:
#
#   1. the gpu tests of what changed (delayed casts, the record and transpose kernels, the producer-fused
#      path against the unfused one, weight cache, quantized linear); their log is kept even if one fails;
#   2. benchmarks/step_table.py on llama3-8b@16L (seq 8192, MBS 1, GBS 8): bf16 and fp8-delayed from
#      the baseline tree MAIN, then fp8-delayed from this tree. Ratios against MAIN's bf16 row.
#
# Run from the root of this tree (about 6 minutes on one H200), e.g. with this tree copied into
# .dev-delayed-te/ of a main checkout:
#
#     cd .dev-delayed-te && PYTHONPATH=. OUT=$OUT bash benchmarks/delayed_te.sh ..
#
# The tests stop after TEST_TIMEOUT seconds (default 300) so the table still runs.
# Writes $OUT/tests.log, $OUT/main.log, $OUT/branch.log, $OUT/device.txt and each tree's step tables
# ($OUT/main/table.json, $OUT/branch/table.json).
set -euo pipefail

MAIN=${1:-}
OUT=${OUT:-delayed-te}
PYTHON=${PYTHON:-python3}
if [[ -z "$MAIN" || ! -f "$MAIN/benchmarks/step_table.py" ]]; then
    echo "delayed_te: give the baseline tree (an lpbench checkout with benchmarks/step_table.py) as the argument" >&2
    exit 2
fi
MAIN=$(cd "$MAIN" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/device.txt"
cat "$OUT/device.txt"

echo "== gpu tests (this tree)"
PYTHONPATH=. timeout "${TEST_TIMEOUT:-300}" "$PYTHON" -m pytest -q -m gpu tests/test_kernels_fp8.py tests/test_weight_cache.py \
    tests/test_linear.py 2>&1 | tail -40 | tee "$OUT/tests.log" || true

TABLE=(--model llama3-8b --num-layers 16 --seq-len 8192 --mbs 1 --gbs 8 --steps 5 --warmup-steps 2
       --no-profile --timeout 120)
echo "== baseline $MAIN: bf16, fp8-delayed"
(cd "$MAIN" && PYTHONPATH=. "$PYTHON" benchmarks/step_table.py "${TABLE[@]}" --rows bf16,fp8-delayed \
    --results "$OUT/main") 2>&1 | tee "$OUT/main.log"
echo "== this tree: fp8-delayed"
PYTHONPATH=. "$PYTHON" benchmarks/step_table.py "${TABLE[@]}" --rows fp8-delayed --results "$OUT/branch" 2>&1 \
    | tee "$OUT/branch.log"
