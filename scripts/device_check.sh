#!/usr/bin/env bash
# One device call: versions, GPU tests (kernels vs reference and fp64), then every benchmark,
# most important first. Usage on the GPU machine, from the repo root:
#   bash scripts/device_check.sh            # everything
#   TESTS="tests/ops/test_gather_dequant_triton.py" bash scripts/device_check.sh   # fewer tests
# Each stage has its own time limit so that one slow stage cannot eat the others' results.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
stage() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "(exit $?)"; tail -"${TAIL:-30}" "$OUT/$name.log"; }
# shellcheck disable=SC2086
TAIL=6 stage tests 150 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/ops tests/test_cuda.py tests/test_transformers.py}
stage decode 200 python3 -m longctx bench decode --contexts 4k,128k,512k --batch 1 --formats int4,int8,bf16 --json "$OUT/decode.json"
TAIL=14 stage e2e 200 python3 -m longctx bench e2e --context 128k --formats int4 --json "$OUT/e2e.json"
TAIL=12 stage seal 45 python3 -m longctx bench seal --context 128k --formats int4,int8
TAIL=12 stage prefill 45 python3 -m longctx bench prefill --contexts 32k,128k --json "$OUT/prefill.json"
TAIL=12 stage decode_b8 45 python3 -m longctx bench decode --contexts 32k --batch 8 --formats int4 --json "$OUT/decode_b8.json"
TAIL=16 stage decode_graph 60 python3 -m longctx bench decode --contexts 4k,128k --batch 1 --formats int4,bf16 --graph --json "$OUT/decode_graph.json"
TAIL=12 stage decode_p128 45 python3 -m longctx bench decode --contexts 128k,512k --batch 1 --formats int4 --block-size 128 --no-peers
