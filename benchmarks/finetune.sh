#!/usr/bin/env bash
# llama3.2-1b SFT and LoRA on one H100, seq 4096: bf16 against native fp8-tensorwise (compiled), then the
# memory of LoRA's frozen base stored in FP8 against a BF16 base, then mxfp8 and nvfp4 emulated (eager,
# short). About 12 minutes.
# Run from the repository root:  PYTHONPATH=. OUT=/some/dir benchmarks/finetune.sh
set -euo pipefail
PY="${PYTHON:-python3}"
RESULTS="${OUT:-.}/finetune"
"$PY" -m lpbench sweep benchmarks/finetune-h100.yaml --results "$RESULTS" || true
"$PY" -m lpbench sweep benchmarks/finetune-lora-quantized-h100.yaml --results "$RESULTS" || true
"$PY" -m lpbench sweep benchmarks/finetune-emulated-h100.yaml --results "$RESULTS" || true
"$PY" -m lpbench report --results "$RESULTS" --format md
"$PY" -m lpbench report --results "$RESULTS" --format json > "$RESULTS/runs.json"
grep -h "^lpbench: \(sft\|lora\)" "$RESULTS"/sweeps/*/*.log || true  # per run: workload, weight bytes, LoRA storage
