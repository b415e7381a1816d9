#!/usr/bin/env bash
# MoE grouped FP8: the weight-gradient operands' group amaxes in one Triton pass (kernels/fp8_group.py),
# measured against a tree without it, on one H100/H200 in one call (~5 minutes, two compiles per tree).
#
# Run from the root of the tree under test, naming the baseline tree (e.g. main's checkout):
#
#     OUT=/some/dir bash benchmarks/moe_amax.sh MAIN_TREE
#
# 1. this tree's gpu tests of tests/test_moe.py (the kernel against the CPU reference, codes and scales bit for
#    bit; a native MoE layer bit-identical with and without it, eager and compiled);
# 2. benchmarks/moe.py at GBS 8 (mixtral-8x7b and qwen3-30b-a3b cut to 2 blocks; BF16 is each model's baseline
#    in the same process) from MAIN_TREE, then from this tree, each with its own --out under $OUT.
# ALSO=DIR benchmarks a third tree too (e.g. a checkout of branch moe-amax-amaxonly: the amaxes without the
# cast), into $OUT/also; PROFILE=1 then profiles mixtral's bf16 and fp8-rowwise-fast-grads from this tree
# (the last step traced; its CATEGORIES table splits the casts).
# Each step's output goes to $OUT/*.log too; a failing step does not stop the ones after it.
set -uo pipefail

if [[ $# -ne 1 || ! -d "$1/lpbench" ]]; then
    echo "moe_amax.sh: usage: bash benchmarks/moe_amax.sh MAIN_TREE (a checkout holding lpbench/)" >&2
    exit 2
fi
MAIN_TREE=$(cd "$1" && pwd)
HERE=$(pwd)
OUT=${OUT:-moe-amax-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
BENCH=(--models mixtral-8x7b:2,qwen3-30b-a3b:2 --gbs 8 --variants bf16,fp8-rowwise,fp8-rowwise-fast-grads
       --steps 5 --warmup 2 --no-check)
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader | tee "$OUT/device.txt"
echo "this tree: $HERE  baseline tree: $MAIN_TREE  $(date -u +%F\ %H:%M) UTC"

status=0
echo "== gpu tests (this tree)"
PYTHONPATH="$HERE" "$PYTHON" -m pytest -q -m gpu tests/test_moe.py 2>&1 | tee "$OUT/tests.log" || status=1
echo "== benchmark, main tree ($MAIN_TREE)"
(cd "$MAIN_TREE" && PYTHONPATH="$MAIN_TREE" "$PYTHON" benchmarks/moe.py "${BENCH[@]}" --out "$OUT/main") 2>&1 \
    | tee "$OUT/bench-main.log" || status=1
echo "== benchmark, this tree ($HERE)"
PYTHONPATH="$HERE" "$PYTHON" benchmarks/moe.py "${BENCH[@]}" --out "$OUT/branch" 2>&1 | tee "$OUT/bench-branch.log" \
    || status=1
if [[ -n "${ALSO:-}" ]]; then
    ALSO=$(cd "$ALSO" && pwd)
    echo "== benchmark, also ($ALSO)"
    (cd "$ALSO" && PYTHONPATH="$ALSO" "$PYTHON" benchmarks/moe.py "${BENCH[@]}" --out "$OUT/also") 2>&1 \
        | tee "$OUT/bench-also.log" || status=1
fi
if [[ -n "${PROFILE:-}" ]]; then
    echo "== profile, this tree"
    PYTHONPATH="$HERE" "$PYTHON" benchmarks/moe.py --models mixtral-8x7b:2 --gbs 8 \
        --variants bf16,fp8-rowwise-fast-grads --steps 4 --warmup 2 --profile --no-check --out "$OUT/profile" 2>&1 \
        | tee "$OUT/profile.log" || status=1
fi
grep -h "^RESULT\|^device" "$OUT"/bench-*.log
exit $status
