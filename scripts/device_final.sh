#!/usr/bin/env bash
# Re-check after fixes, within a small device budget: the gather tests, e2e, sealing, 512k.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "(exit $?)"; tail -"${TAIL:-30}" "$OUT/$name.log"; }
TAIL=4 stage tests 90 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gather_dequant_triton.py tests/test_cuda.py
TAIL=14 stage e2e 170 python3 -m longctx bench e2e --context 128k --formats int4 --json "$OUT/e2e.json"
TAIL=12 stage seal 45 python3 -m longctx bench seal --context 128k --formats int4,int8
TAIL=12 stage decode512 100 python3 -m longctx bench decode --contexts 512k --batch 1 --formats int4,bf16 --json "$OUT/decode512.json"
