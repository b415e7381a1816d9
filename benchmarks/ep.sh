#!/usr/bin/env bash
# Expert parallelism on 4 GPUs of one node (issue 38.3), one call: EP 4 under FSDP2 and under DDP in
# every precision (mixtral-8x7b@6L, seq 2048: nvfp4 keeps the last 4 blocks in BF16, so 6 blocks
# quantize 2; MXFP8/NVFP4 emulated where the GPU lacks them), then tiny-moe as a smoke test.
# Every run must end "ok"; the log's `moe |` lines give the tokens per EP rank and the imbalance.
#
# Run from the repository root:
#
#     PYTHONPATH=. OUT=/some/dir bash benchmarks/ep.sh
set -uo pipefail

OUT=${OUT:-ep-out}
RESULTS="$OUT/results"
PYTHON=${PYTHON:-python3}
PRECISIONS=${PRECISIONS:-bf16,fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true
failed=0

run() {  # run NAME FLAGS...: one `lpbench run`, its output in $OUT/NAME.log
    local name=$1
    shift
    echo "=== $name: lpbench run $*"
    "$PYTHON" -m lpbench run --results "$RESULTS" "$@" 2>&1 | tee "$OUT/$name.log" || failed=1
}

MOE=(--model mixtral-8x7b --num-layers 6 --seq-len 2048 --mbs 1 --gbs 8 --nproc-per-node 4 --ep 4
     --steps 4 --warmup-steps 2 --emulate --precision "$PRECISIONS")
run ep4-fsdp "${MOE[@]}" --fsdp
run ep4-ddp "${MOE[@]}"
run tiny-moe --model tiny-moe --ep 2 --fsdp --nproc-per-node 2 --steps 4 --warmup-steps 2 --precision bf16,fp8-rowwise

"$PYTHON" -m lpbench report --results "$RESULTS" --format md
exit $failed
