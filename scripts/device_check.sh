#!/usr/bin/env bash
# One device call: versions, GPU tests (kernels vs reference and fp64), then the decode bench.
# Usage on the GPU machine, from the repo root: bash scripts/device_check.sh [bench args...]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -x tests/ops tests/test_cuda.py tests/test_transformers.py 2>&1 | tee "$OUT/tests.log" | tail -15
python3 -m longctx bench decode --json "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
