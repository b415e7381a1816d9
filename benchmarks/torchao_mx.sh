#!/usr/bin/env bash
# llama3.2-1b on one GPU, seq 4096, MBS 2, same seed and data: bf16, lpbench's mxfp8 and a second bf16 seed (the
# loss noise floor), then torchao's mxfp8 (its kernels on compute capability 10.x, its emulation below) and
# torchao's nvfp4 (refused below 10.0, exit 2). lpbench's mxfp8 is emulated below 10.0 (--emulate).
# Then the CPU-checked layout tests under this GPU's torch. About 7 minutes on an H100.
# Run from the repository root:  PYTHONPATH=. OUT=/some/dir benchmarks/torchao_mx.sh  (torchao importable)
set -uo pipefail
PY="${PYTHON:-python3}"
RESULTS="${OUT:-.}/torchao-mx"
RUN=(-m lpbench run --model llama3.2-1b --seq-len 4096 --mbs 2 --gbs 2 --steps "${STEPS:-30}" --warmup-steps 10
     --emulate --results "$RESULTS")
"$PY" -c "import torch, torchao; print('torch', torch.__version__, '| torchao', torchao.__version__, '|',
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
"$PY" "${RUN[@]}" --precision bf16,mxfp8
"$PY" "${RUN[@]}" --precision bf16 --seed 1 --results "$RESULTS/seed1"
"$PY" "${RUN[@]}" --precision mxfp8 --backend torchao || "$PY" "${RUN[@]}" --precision mxfp8 --backend torchao --no-compile
"$PY" "${RUN[@]}" --precision nvfp4 --backend torchao; echo "torchao nvfp4 exit code: $?"
"$PY" -m pytest -q tests/test_block_scaled.py tests/test_torchao_backend.py -p no:cacheprovider
"$PY" -m lpbench report --results "$RESULTS" --format md
