#!/usr/bin/env bash
# Scale-out on one node with 2 GPUs (issue 5): llama3.2-1b, seq 4096, MBS 2, BF16 and FP8 (tensorwise,
# lpbench native) on 1 GPU, then 2 GPUs with DDP, FSDP2, FSDP2 + FP8 all-gather, and TP=2.
#
# Run from the repository root (a few minutes, eager):
#
#     PYTHONPATH=. OUT=/some/dir bash benchmarks/distributed.sh
#
# Weak scaling for the data-parallel runs: every GPU does the same work per step (one micro-batch
# of 2 x 4096 tokens): GBS 2 on 1 GPU, GBS 4 on 2. So scaling efficiency = tokens/s/GPU on 2 GPUs
# / tokens/s/GPU on 1 GPU, per precision (the report's "Tokens / sec / GPU" column). The TP=2 run
# splits one GBS-2 step over both GPUs instead (strong scaling: same tokens per step as 1 GPU).
# Each `lpbench run` is one comparison group in the report (BF16 first, so FP8 gets a speedup).
#
# torch.compile is off by default: eight compilations would not fit a few minutes. COMPILE=--compile
# measures the compiled programs instead (budget ~1-2 minutes more per run).
set -uo pipefail

OUT=${OUT:-distributed-out}
RESULTS="$OUT/results"
PYTHON=${PYTHON:-python3}
COMPILE=${COMPILE:---no-compile}
STEPS=${STEPS:-15}
# NVLink multicast off for every multi-GPU run (NCCL NVLS, symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true
COMMON=(--model llama3.2-1b --seq-len 4096 --mbs 2 --steps "$STEPS" --warmup-steps 5 "$COMPILE"
        --results "$RESULTS" --log-interval 5)
failed=0

run() {  # run NAME FLAGS...: one `lpbench run`, its output in $OUT/NAME.log
    local name=$1
    shift
    echo "=== $name: lpbench run $*"
    "$PYTHON" -m lpbench run "${COMMON[@]}" "$@" 2>&1 | tee "$OUT/$name.log" || failed=1
}

run 1gpu          --gbs 2 --precision bf16,fp8-tensorwise
run 2gpu-ddp      --gbs 4 --nproc-per-node 2 --precision bf16,fp8-tensorwise
run 2gpu-fsdp     --gbs 4 --nproc-per-node 2 --fsdp --precision bf16,fp8-tensorwise
run 2gpu-fsdp-fp8ag --gbs 4 --nproc-per-node 2 --fsdp --fsdp-fp8-all-gather --precision fp8-tensorwise
run 2gpu-tp       --gbs 2 --nproc-per-node 2 --tp 2 --precision fp8-tensorwise

"$PYTHON" -m lpbench report --results "$RESULTS" --format md
exit $failed
