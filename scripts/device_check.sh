#!/usr/bin/env bash
# One device call: versions, GPU tests (kernels vs reference and fp64), then every benchmark.
# Usage on the GPU machine, from the repo root: bash scripts/device_check.sh
# Each stage has its own time limit so that one slow stage cannot eat the others' results.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
stage() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -${TAIL:-30}; }
TAIL=8 stage tests 200 python3 -m pytest -q -p no:cacheprovider tests/ops tests/test_cuda.py tests/test_transformers.py
stage decode 120 python3 -m longctx bench decode --contexts 4k,128k,512k --batch 1 --formats int4,int8,bf16 --json "$OUT/decode.json"
stage decode_b8 60 python3 -m longctx bench decode --contexts 32k --batch 8 --formats int4 --json "$OUT/decode_b8.json"
stage decode_graph 90 python3 -m longctx bench decode --contexts 4k,32k,128k --batch 1 --formats int4,bf16 --graph --json "$OUT/decode_graph.json"
stage seal 60 python3 -m longctx bench seal --context 128k --formats int4,int8
stage prefill 60 python3 -m longctx bench prefill --contexts 32k,128k --json "$OUT/prefill.json"
stage e2e 200 python3 -m longctx bench e2e --context 128k --formats int4 --json "$OUT/e2e.json"
