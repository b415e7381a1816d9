#!/usr/bin/env bash
# Layouts on 4 GPUs of one node (issues 37.1, 38.1-38.3), one call:
#  - EP:  expert parallelism under FSDP2 and DDP in every precision (mixtral-8x7b@6L: nvfp4 keeps the
#         last 4 blocks in BF16; EP 4), then
#         tiny-moe as a smoke test. Each run must end "ok"; the log's `moe |` lines give the tokens
#         per EP rank and the imbalance.
#  - FSDP weak scaling: llama3-8b@16L, seq 8192, MBS 1, GBS 8 per GPU: 1 GPU, then 4 GPUs with DDP
#         and FSDP2 in each --fsdp-shard mode (and zero1 with BF16 gradient reduction). The 1-GPU run
#         needs about 95 GB (an H200); on H100s run PART=scale with ONE_GPU=0 and compare the modes.
#
# Run from the repository root:
#
#     PYTHONPATH=. OUT=/some/dir bash benchmarks/layout.sh          # PART=ep or PART=scale for one half
#
# Scaling efficiency = tokens/s/GPU of a 4-GPU row / the 1-GPU row's, per precision (the report's
# "Tokens / sec / GPU" column).
set -uo pipefail

OUT=${OUT:-layout-out}
RESULTS="$OUT/results"
PYTHON=${PYTHON:-python3}
PART=${PART:-}
ONE_GPU=${ONE_GPU:-1}
STEPS=${STEPS:-12}
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

if [[ "$PART" != scale ]]; then
    ALL=bf16,fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4
    MOE=(--model mixtral-8x7b --num-layers 6 --seq-len 2048 --mbs 1 --gbs 8 --nproc-per-node 4 --ep 4
         --steps 4 --warmup-steps 2 --emulate --precision "$ALL")
    run ep4-fsdp "${MOE[@]}" --fsdp
    run ep4-ddp "${MOE[@]}"
    run tiny-moe --model tiny-moe --ep 2 --fsdp --nproc-per-node 2 --steps 4 --warmup-steps 2 --precision bf16,fp8-rowwise
fi
if [[ "$PART" != ep ]]; then
    DENSE=(--model llama3-8b --num-layers 16 --seq-len 8192 --mbs 1 --steps "$STEPS" --warmup-steps 5
           --log-interval 5 --precision bf16,fp8-tensorwise)
    [[ "$ONE_GPU" == 1 ]] && run 1gpu "${DENSE[@]}" --gbs 8
    run 4gpu-ddp "${DENSE[@]}" --gbs 32 --nproc-per-node 4
    for shard in zero3 zero2 zero1; do
        run "4gpu-fsdp-$shard" "${DENSE[@]}" --gbs 32 --nproc-per-node 4 --fsdp --fsdp-shard "$shard"
    done
    run 4gpu-fsdp-zero1-bf16-reduce "${DENSE[@]}" --gbs 32 --nproc-per-node 4 --fsdp --fsdp-shard zero1 \
        --grad-reduce-dtype bf16
fi

"$PYTHON" -m lpbench report --results "$RESULTS" --format md
exit $failed
