#!/usr/bin/env bash
# Scale-out on one node with 2 GPUs (issue 5).
#  - llama3.2-1b, seq 4096, MBS 2, BF16 and FP8 (tensorwise, lpbench native): 1 GPU, then 2 GPUs
#    with DDP, FSDP2, FSDP2 + FP8 all-gather, and TP=2.
#  - llama3-8b, seq 8192, MBS 1, FSDP2 on 2 GPUs: BF16, FP8 tensorwise, and FP8 with FP8 all-gather
#    (the 4-GPU run, scaled to the 2 GPUs lent).
#
# Run from the repository root (about 8 minutes on 2 H200):
#
#     PYTHONPATH=. OUT=/some/dir bash benchmarks/distributed.sh
#
# Weak scaling for the data-parallel runs: every GPU does the same work per step (one micro-batch
# of 2 x 4096 tokens): GBS 2 on 1 GPU, GBS 4 on 2. So scaling efficiency = tokens/s/GPU on 2 GPUs
# / tokens/s/GPU on 1 GPU, per precision (the report's "Tokens / sec / GPU" column). The TP=2 run
# splits one GBS-2 step over both GPUs instead (strong scaling: same tokens per step as 1 GPU).
# Each `lpbench run` is one comparison group in the report (BF16 first, so FP8 gets a speedup).
# torch.compile per block (the default): COMPILE=--no-compile measures eager code instead.
# ONLY=8b runs the llama3-8b part alone, ONLY=1b the llama3.2-1b part.
set -uo pipefail

OUT=${OUT:-distributed-out}
RESULTS="$OUT/results"
PYTHON=${PYTHON:-python3}
COMPILE=${COMPILE:---compile}
ONLY=${ONLY:-}
STEPS=${STEPS:-15}
# NVLink multicast off for every multi-GPU run (NCCL NVLS, symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true
COMMON=(--steps "$STEPS" --warmup-steps 5 "$COMPILE" --results "$RESULTS" --log-interval 5)
ONE_B=(--model llama3.2-1b --seq-len 4096 --mbs 2)
EIGHT_B=(--model llama3-8b --seq-len 8192 --mbs 1 --gbs 2 --nproc-per-node 2 --fsdp)
failed=0

run() {  # run NAME FLAGS...: one `lpbench run`, its output in $OUT/NAME.log
    local name=$1
    shift
    echo "=== $name: lpbench run $*"
    "$PYTHON" -m lpbench run "${COMMON[@]}" "$@" 2>&1 | tee "$OUT/$name.log" || failed=1
}

if [[ "$ONLY" != 8b ]]; then
    run 1gpu            "${ONE_B[@]}" --gbs 2 --precision bf16,fp8-tensorwise
    run 2gpu-ddp        "${ONE_B[@]}" --gbs 4 --nproc-per-node 2 --precision bf16,fp8-tensorwise
    run 2gpu-fsdp       "${ONE_B[@]}" --gbs 4 --nproc-per-node 2 --fsdp --precision bf16,fp8-tensorwise
    run 2gpu-fsdp-fp8ag "${ONE_B[@]}" --gbs 4 --nproc-per-node 2 --fsdp --fsdp-fp8-all-gather --precision fp8-tensorwise
    run 2gpu-tp         "${ONE_B[@]}" --gbs 2 --nproc-per-node 2 --tp 2 --precision bf16,fp8-tensorwise
fi
if [[ "$ONLY" != 1b ]]; then
    run 8b-fsdp         "${EIGHT_B[@]}" --precision bf16,fp8-tensorwise
    run 8b-fsdp-fp8ag   "${EIGHT_B[@]}" --fsdp-fp8-all-gather --precision fp8-tensorwise
fi

"$PYTHON" -m lpbench report --results "$RESULTS" --format md
exit $failed
