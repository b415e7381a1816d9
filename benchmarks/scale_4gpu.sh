#!/usr/bin/env bash
# Issue 38's scale-out tables in one call on 4 GPUs of one host: runs within $BUDGET seconds (default 430, leaving
# time to read the profiled traces; a run not started in time is listed as skipped, so the rows come in this order
# of priority): benchmarks/scale.py runs
# each layout as its own `lpbench run` under coreutils timeout (1- and 2-GPU runs one per precision, side by
# side on free GPUs), logs and results under $OUT.
#
#   1. weak scaling, llama3-8b@16L, seq 8192, GBS 8 a GPU: 1 GPU, DDP, FSDP2 and FSDP2 zero1 on 2 and 4 GPUs, BF16 and
#      fp8-tensorwise; the 4-GPU FSDP2 rows profile one more step: NCCL ms and exposed NCCL ms per step;
#   2. full llama3-8b FSDP2 on 4 GPUs, GBS 32 (zero3, and zero1 with BF16 gradient reduction); MoE under EP 4 +
#      FSDP2 zero1 with BF16 reduction (on EP 2 as fast as DDP, zero3 slower: RESULTS 2026-11-28 11:56–12:29):
#      mixtral-8x7b@6L and qwen3-30b-a3b at 6 and 12 blocks (seq 4096, GBS 16), BF16 and fp8-rowwise, qwen3
#      extrapolated linearly to 48 blocks; mixtral's with --ep-chunks 2 (A/B against mixtral@6L; cuts that
#      `lpbench memory` fits in 80 GB);
#   3. FSDP2 knobs on 4 GPUs (A/B against the 4-GPU fsdp rows of the same call): zero1, FP8 all-gather, zero1 with
#      BF16 gradient reduction, with and without FP8 all-gather, BF16 reduction alone, zero2, NCCL on at most 8
#      channels (SMs).
#
# Run from the repository root (PART=table, moe or fsdp runs one part alone, fsdp with the 1-GPU and 4-GPU fsdp
# rows its ratios need, or 2-GPU ones with GPUS=2 on a 2-GPU machine; PROFILE= turns the profiled step off):
#
#     PYTHONPATH=. OUT=/some/dir bash benchmarks/scale_4gpu.sh
set -uo pipefail

OUT=${OUT:-scale-out}
BUDGET=${BUDGET:-430}
GPUS=${GPUS:-4}  # the machine's GPUs (PART=fsdp only: the other parts need 4)
PYTHON=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true
git rev-parse --short HEAD > "$OUT/tree.txt" 2>/dev/null || true

MOE="--seq-len 4096 --mbs 1 --gbs 16 --ep 4 --fsdp --fsdp-shard zero1 --grad-reduce-dtype bf16"
MOE+=" --steps 6 --warmup-steps 3 --precision bf16,fp8-rowwise"
TABLE=(--gpus 1,2,4 --layouts "ddp,fsdp,fsdp-zero1=--fsdp --fsdp-shard zero1")
# full llama3-8b at GBS 32 holds ~105 GB a GPU (FSDP2 accumulates whole FP32 gradients): on cards below 100 GB it
# runs with the chunked loss, BF16 gradient reduction and selective recomputation, and its row name says so
FULL_NAME=llama3-8b FULL_FLAGS="--model llama3-8b --seq-len 8192 --mbs 1 --gbs 32 --fsdp --steps 4 --warmup-steps 2"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -n "$MIB" ] && [ "$MIB" -lt 100000 ]; then
    FULL_NAME=llama3-8b-fit80 FULL_FLAGS="$FULL_FLAGS --fused-loss --grad-reduce-dtype bf16 --recompute selective"
fi
FULL=(--row "$FULL_NAME:4:$FULL_FLAGS")
if [ "$FULL_NAME" = llama3-8b ]; then  # zero1 + BF16 reduction: the fastest FSDP2 mode where it fits (~101-103 GB)
    FULL+=(--row "llama3-8b-zero1-bf16red:4:$FULL_FLAGS --fsdp-shard zero1 --grad-reduce-dtype bf16")
fi
MOE_ROWS=(
    --row "mixtral@6L:4:--model mixtral-8x7b --num-layers 6 $MOE"
    --row "qwen3@6L:4:--model qwen3-30b-a3b --num-layers 6 $MOE"
    --row "qwen3@12L:4:--model qwen3-30b-a3b --num-layers 12 $MOE"
    --row "mixtral@6L-chunks2:4:--model mixtral-8x7b --num-layers 6 $MOE --ep-chunks 2"
    --extrapolate "qwen3@6L,qwen3@12L:48"
)
KNOBS=(
    --knob "fsdp-zero1=--fsdp --fsdp-shard zero1"
    --knob "fsdp-fp8ag=--fsdp --fsdp-fp8-all-gather --precision fp8-tensorwise"
    --knob "fsdp-zero1-bf16red=--fsdp --fsdp-shard zero1 --grad-reduce-dtype bf16"
    --knob "fsdp-zero1-fp8ag-bf16red=--fsdp --fsdp-shard zero1 --fsdp-fp8-all-gather --grad-reduce-dtype bf16 --precision fp8-tensorwise"
    --knob "fsdp-bf16red=--fsdp --grad-reduce-dtype bf16 --precision bf16"
    --knob "fsdp-zero2=--fsdp --fsdp-shard zero2 --precision bf16"
    --knob "fsdp-nccl8=NCCL_MAX_NCHANNELS=8 --fsdp --precision bf16"
)
case "${PART:-all}" in  # a part alone, for a second call: its own baselines come with it
    all) ARGS=("${TABLE[@]}" "${FULL[@]}" "${MOE_ROWS[@]}" "${KNOBS[@]}") ;;
    table) ARGS=("${TABLE[@]}" "${FULL[@]}") ;;
    moe) ARGS=(--gpus 4 --layouts "" "${MOE_ROWS[@]}") ;;
    fsdp) ARGS=(--gpus "1,$GPUS" --layouts fsdp "${KNOBS[@]}") ;;
    *) echo "scale_4gpu.sh: PART must be all, table, moe or fsdp" >&2; exit 2 ;;
esac
"$PYTHON" benchmarks/scale.py \
    --model llama3-8b --num-layers 16 --seq-len 8192 --mbs 1 --gbs-per-gpu 8 --steps 5 --warmup-steps 2 \
    --precision bf16,fp8-tensorwise --profile-layouts "${PROFILE-fsdp}" "${ARGS[@]}" \
    --gpus-available "$GPUS" --timeout 240 --budget "$BUDGET" --out "$OUT" 2>&1 | tee "$OUT/scale.log"
exit "${PIPESTATUS[0]}"
