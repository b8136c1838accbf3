#!/usr/bin/env bash
# GPU test run sharded over N pytest processes (compiling Triton variants is CPU-bound, the
# GPU work small): collects the node ids of the given test paths (and -k expression), deals
# them round-robin into N shards, runs the shards in parallel, one log each in $OUT, and
# prints each shard's summary and failures.
#   N=4 bash scripts/gpu_tests.sh tests/ops/test_paged_attention_triton.py
#   N=4 K="side" bash scripts/gpu_tests.sh tests/ops
#   ARCHS=80,86,89 bash scripts/gpu_tests.sh tests/ops   # also compile each kernel for those GPUs (scripts/arch_compile.py)
#   IDS=ids.txt bash scripts/gpu_tests.sh                 # the node ids listed in ids.txt
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1  # (a Triton put first stays first)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${N:-4}
PLUGIN=()
if [ -n "${ARCHS:-}" ]; then
  export LONGCTX_ARCHS=$ARCHS ARCH_REPORT=$OUT/arch; PLUGIN=(-p scripts.arch_compile)
  rm -rf "$ARCH_REPORT"  # (an earlier run's reports in the same $OUT would join this one's summary)
fi
ids=$OUT/test_ids.txt
if [ -n "${IDS:-}" ]; then  # IDS=FILE: these node ids, one a line, instead of collecting
  cp "$IDS" "$ids"; : > "$OUT/collect.log"
else
  python3 -m pytest -q -p no:cacheprovider --collect-only ${K:+-k "$K"} "$@" > "$OUT/collect.log" 2>&1
  grep "::" "$OUT/collect.log" > "$ids"
fi
echo "$(wc -l < "$ids") tests in $N shards"
if [ ! -s "$ids" ]; then  # (an empty shard would run pytest on the whole tests folder)
  echo "no tests collected:"; tail -15 "$OUT/collect.log"; exit 1
fi
for i in $(seq 0 $((N - 1))); do
  awk -v n="$N" -v i="$i" 'NR % n == i' "$ids" > "$OUT/shard$i.txt"
  (tr '\n' '\0' < "$OUT/shard$i.txt" | xargs -0 -r python3 -m pytest -q -p no:cacheprovider ${PLUGIN[@]+"${PLUGIN[@]}"} -rf > "$OUT/shard$i.log" 2>&1) &
done
wait
for i in $(seq 0 $((N - 1))); do
  echo "-- shard $i: $(tail -1 "$OUT/shard$i.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/shard$i.log" | head -10
done
if [ -n "${ARCHS:-}" ]; then
  python3 scripts/arch_compile.py "$OUT/arch"
fi
