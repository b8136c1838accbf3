#!/usr/bin/env bash
# The GPU checks, for a device call: versions, then the named stages, each under its own time
# limit with its whole log in $OUT (a call's reply shows only the tail). A call runs at most
# 10 minutes, so name the stages that fit:
#   bash tools/gpu_check.sh tests                 # the GPU test files (kernels vs reference and fp64, graphs, transformers)
#   bash tools/gpu_check.sh decode                # the decode bench's rows: 4k, 128k, 512k at batch 1 and 32k at batch 8
#   BASE=.baseline bash tools/gpu_check.sh decode # the same bench from another tree's package first (carry it), then this one
#   bash tools/gpu_check.sh prefill seal e2e plan # the other benches (plan: longctx plan against a measured peak in 24 GiB)
#   bash tools/gpu_check.sh floor                 # the fastest plain read of a decode step's bytes (tools/read_floor.py)
#   bash tools/gpu_check.sh split                 # bench e2e --device-map auto: one GPU against the model split over every GPU
#   PLAN_ARGS="--gpus 2 --weights-bits 4" bash tools/gpu_check.sh plan   # (two GPUs) each card's peak against plan --gpus 2
#   OFFLOAD_ARGS="--contexts 1024k" bash tools/gpu_check.sh offload   # bench offload (NF4: carry .whl, below)
#   bash tools/gpu_check.sh disk                  # bench disk: a saved cache loaded against prefill (DISK_ARGS for options)
#   FLASH_TAR=.flash/flash-attn-2.8.3.post2-sm90.tar.xz bash tools/gpu_check.sh flash   # with flash-attn (tools/pack_flash_attn.sh)
#   TRITON_TAR=.triton/triton-3.8.0.tar.xz bash tools/gpu_check.sh tests                 # on a carried Triton (tools/pack_triton.sh)
#   TESTS="tests/ops/test_gather_dequant_triton.py" bash tools/gpu_check.sh tests
#   TESTS_K="host or load_in_4bit" TESTS_LIMIT=120 TESTS="tests/test_offload.py tests/test_cuda.py" bash tools/gpu_check.sh tests
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "${TRITON_TAR:-}" ]; then
  alt=/tmp/triton_alt/$(basename "$TRITON_TAR" .tar.xz); mkdir -p "$alt"
  [ -d "$alt/triton" ] || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$TRITON_TAR" "$alt"
  chmod +x "$alt"/triton/backends/*/bin/*
  export PYTHONPATH=$alt:$PYTHONPATH
fi
if [ -n "${FLASH_TAR:-}" ]; then  # flash-attn's binding compiled against the image's torch and linked with the packed kernels
  fa=/tmp/flash_alt; rm -rf $fa; mkdir -p $fa
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$FLASH_TAR" "$fa"
  d=$(ls -d $fa/flash-attn-*-sm90)
  timeout 400 python3 tools/link_flash_attn.py "$d" > "$OUT/flash_link.log" 2>&1 || { tail -30 "$OUT/flash_link.log"; exit 1; }
  export PYTHONPATH=$d/python:$PYTHONPATH
fi
# carried wheels (.whl/*.whl, e.g. bitsandbytes for the 4-bit loading test: pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 -d .whl bitsandbytes, and carry .whl)
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
STAGES=("$@")
want_stage() { [ ${#STAGES[@]} -eq 0 ] && return 0; local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
stage() {
  local name=$1 limit=$2; shift 2; want_stage "$name" || return 0
  echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "(exit $?)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -20; tail -"${TAIL:-30}" "$OUT/$name.log"
}
DECODE=(-m longctx bench decode --graph --cases 4k:1,128k:1,512k:1,32k:8 --formats int4,int8,bf16,int2)
# the tests' time is mostly Triton compiling kernel variants on the CPU: spread over WORKERS
# processes (pytest-xdist, in the device image; 1: one process)
XDIST=(); python3 -c "import xdist" 2>/dev/null && [ "${WORKERS:-12}" != 1 ] && XDIST=(-n "${WORKERS:-12}")
# shellcheck disable=SC2086
KEXPR=(); [ -n "${TESTS_K:-}" ] && KEXPR=(-k "$TESTS_K")  # (a -k expression of several words: TESTS_K="host or graphs")
TAIL=4 stage tests "${TESTS_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider --durations=30 "${XDIST[@]}" "${KEXPR[@]}" ${TESTS:-tests/ops tests/test_cuda.py tests/test_transformers.py tests/test_offload.py tests/test_devices.py}
if [ -n "${BASE:-}" ] && want_stage decode; then  # the same bench from BASE's package (a tree carried as BASE/longctx) first
  STAGES+=(decode_base)
  PYTHONPATH=$PWD/$BASE TAIL=14 stage decode_base 280 python3 "${DECODE[@]}" --json "$OUT/decode_base.json"
fi
TAIL=14 stage decode 280 python3 "${DECODE[@]}" --json "$OUT/decode.json"
TAIL=24 stage prefill 200 python3 -m longctx bench prefill --contexts 32k,128k --chunks 16,512,16k --json "$OUT/prefill.json"
TAIL=12 stage seal 90 python3 -m longctx bench seal --context 128k --formats int4,int8
TAIL=14 stage e2e 420 python3 -m longctx bench e2e --context 128k --formats int4 --json "$OUT/e2e.json"
TAIL=16 stage floor 420 python3 tools/read_floor.py
TAIL=14 stage split 420 python3 -m longctx bench e2e --device-map auto --context "${SPLIT_CONTEXT:-32k}" --formats int4 --json "$OUT/split.json"
TAIL=14 stage plan 400 python3 -m longctx bench plan --budget-gib 24 ${PLAN_ARGS:-} --json "$OUT/plan.json"
TAIL=30 stage offload 560 python3 -m longctx bench offload ${OFFLOAD_ARGS:-} --json "$OUT/offload.json"
TAIL=12 stage disk 560 python3 -m longctx bench disk ${DISK_ARGS:-} --json "$OUT/disk.json"
TAIL=8 stage flash 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/ops/test_paged_attention.py tests/test_cli.py -k "flash or bench_decode or info"
