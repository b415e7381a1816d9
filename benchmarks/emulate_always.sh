#!/usr/bin/env bash
# --emulate always on a GPU that runs fp8-tensorwise natively: lpbench's and torchao's native FP8 against the same
# linears forced through each library's emulation (lpbench: BF16 operands, FP32 accumulation; torchao:
# Float8LinearConfig.emulate), llama3.2-1b cut to its first LAYERS blocks, seq 4096, MBS 2, same seed and data.
# Then torchao's nvfp4 (refused below compute capability 10.0, exit 2) and the GPU tests of the dispatch.
# Run from the repository root:  PYTHONPATH=. OUT=/some/dir benchmarks/emulate_always.sh  (torchao importable)
set -uo pipefail
PY="${PYTHON:-python3}"
RESULTS="${OUT:-.}/emulate-always"
RUN=(-m lpbench run --model llama3.2-1b --num-layers "${LAYERS:-4}" --seq-len 4096 --mbs 2 --gbs 2
     --steps "${STEPS:-12}" --warmup-steps 4 --precision fp8-tensorwise --results "$RESULTS")
"$PY" -c "import torch, torchao; print('torch', torch.__version__, '| torchao', torchao.__version__, '|',
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
for backend in lpbench torchao; do
  "$PY" "${RUN[@]}" --backend "$backend" --no-emulate
  "$PY" "${RUN[@]}" --backend "$backend" --emulate always
done
"$PY" "${RUN[@]}" --precision nvfp4 --backend torchao --emulate always; echo "torchao nvfp4 exit code: $?"
"$PY" -m pytest -q tests/test_emulate.py tests/test_torchao_backend.py -p no:cacheprovider
"$PY" -m lpbench report --results "$RESULTS" --format md
