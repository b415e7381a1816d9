#!/usr/bin/env bash
# Convergence study (issue 7) on one H100: llama-125m on the offline documentation corpus,
# BF16 / FP8 (current and delayed scaling) / MXFP8 / NVFP4, plus NVFP4 with each of its
# ingredients switched off (RHT, stochastic rounding, 2-D weight blocks, BF16 last layers).
# Every recipe: same init (seed 1234), same data order, TOKENS training tokens.
#
# Run from the repository root, with the prepared corpus in .corpus/prepared/ (README.md,
# "Real corpus": docs_text_document.{bin,idx,lpbench.json} and tokenizer.json, 56 MiB):
#
#     PYTHONPATH=. bash benchmarks/converge-study.sh [extra converge flags, which win]
#
# Writes into $OUT (default ./converge-study): results.db (one row per recipe, workload
# 'converge'), converge-llama-125m.png (loss curves and gaps), converge.log (the run's output).
#
# Budget. H100 has no MX/NVFP4 GEMMs, so mxfp8 and nvfp4 run emulated (BF16 GEMMs on exactly
# dequantized operands, eager reference quantizers); their cost, not BF16's, sets the budget.
# Not measured yet; estimated from benchmarks/RESULTS.md's linear timings scaled to these shapes,
# in microseconds per training token: bf16 ~6, fp8-* ~7, mxfp8 ~22, nvfp4 and three ablations
# ~37 each, nvfp4-no-bf16-tail ~52: ~250 us per token for all nine runs, plus ~10% validation,
# so 1.5 M tokens per recipe is about 7 minutes (plus ~1 minute of start-up). Each run prints
# its tokens/s; a finished run is already in results.db if the call is cut short (the ablations
# run last). Scale with TOKENS=..., e.g. TOKENS=5000000 for a ~25-minute study.
# torch.compile is off: nine compilations, one per recipe, would cost minutes of their own.
set -euo pipefail

OUT=${OUT:-converge-study}
TOKENS=${TOKENS:-1500000}
DATA=${DATA:-.corpus/prepared/docs_text_document}
PYTHON=${PYTHON:-python3}

if [[ ! -f "$DATA.bin" || ! -f "$DATA.idx" ]]; then
    echo "converge-study: no prepared corpus at $DATA.bin/.idx (see README.md, 'Real corpus')" >&2
    exit 2
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true

# 8 x 1024 = 8,192 tokens per step (183 steps at 1.5 M tokens); validation on 64 held-out
# sequences of the corpus's 1% tail every 30 steps and at the last step.
"$PYTHON" -m lpbench converge --model llama-125m --data "$DATA" \
    --precision bf16,fp8-tensorwise,fp8-delayed,mxfp8,nvfp4 --ablate rht,sr,2d,bf16-tail \
    --tokens "$TOKENS" --seq-len 1024 --mbs 8 --gbs 8 --lr 6e-4 \
    --eval-every 30 --eval-batches 8 --device cuda --emulate --no-compile \
    --results "$OUT" --plot "$OUT/converge-llama-125m.png" --log-interval 20 "$@" 2>&1 | tee "$OUT/converge.log"
