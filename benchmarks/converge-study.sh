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
# Budget: torch.compile per block (each recipe compiles one block, ~20-40 s). H100 has no
# MX/NVFP4 GEMMs, so mxfp8 and nvfp4 run emulated (BF16 GEMMs on exactly dequantized operands,
# compiled quantizers); their cost, not BF16's, sets the budget. Each run prints its tokens/s;
# a finished run is already in results.db if the call is cut short (the ablations run last).
# Scale with TOKENS=...; 32 K tokens per step (MBS 32 x 1024). On one H100 the default 10 M tokens
# take about 13 minutes: 5.5 for the five recipes, 7.5 for BF16, NVFP4 and the four ablations
# (which is how benchmarks/RESULTS.md ran it, in two calls: ABLATE= bash ..., then
# PRECISION=bf16,nvfp4 bash ...).
set -euo pipefail

OUT=${OUT:-converge-study}
TOKENS=${TOKENS:-10000000}
EVAL_EVERY=${EVAL_EVERY:-50}
PRECISION=${PRECISION:-bf16,fp8-tensorwise,fp8-delayed,mxfp8,nvfp4}
ABLATE=${ABLATE-rht,sr,2d,bf16-tail}  # empty: no ablation runs
NOISE_SEEDS=${NOISE_SEEDS:-2}  # BF16 again with 2 other seeds: the noise floor of the gaps (~25 s each)
DATA=${DATA:-.corpus/prepared/docs_text_document}
PYTHON=${PYTHON:-python3}

if [[ ! -f "$DATA.bin" || ! -f "$DATA.idx" ]]; then
    echo "converge-study: no prepared corpus at $DATA.bin/.idx (see README.md, 'Real corpus')" >&2
    exit 2
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true

# 32 x 1024 = 32,768 tokens per step (305 steps at 10 M tokens); validation on 256 held-out
# sequences of the corpus's 1% tail every EVAL_EVERY steps and at the last step.
"$PYTHON" -m lpbench converge --model llama-125m --data "$DATA" \
    --precision "$PRECISION" ${ABLATE:+--ablate "$ABLATE"} --noise-seeds "$NOISE_SEEDS" \
    --tokens "$TOKENS" --seq-len 1024 --mbs 32 --gbs 32 --lr 6e-4 \
    --eval-every "$EVAL_EVERY" --eval-batches 8 --device cuda --emulate \
    --results "$OUT" --plot "$OUT/converge-llama-125m.png" --log-interval 20 "$@" 2>&1 | tee "$OUT/converge.log"
