#!/usr/bin/env bash
# Pack flash-attn for the GPU machine, which has no flash-attn, no registry and ten minutes a
# call. PyPI has flash-attn 2 only as source (8.5 MB; a full build compiles 72 kernel files for
# four architectures, hours on two cores), so this builds what `flash_attn_with_kvcache` needs,
# here, with this machine's nvcc (13.0, as the image's): the 48 forward kernel files (plain and
# split-KV, every head_dim and dtype) for sm_90 only, against the headers of the image's torch
# (2.11.0+cu130, from its PyPI wheel), with flash-attn's own switches that leave out what no
# caller here uses (dropout, ALiBi, softcap, local windows, head_dims other than the kernels'
# 32, 64, 96, 128, 192 and 256, the backward pass). flash_api.cpp (the Python binding) is
# compiled and linked on the device (tools/link_flash_attn.py through gpu_check.sh's
# FLASH_TAR), against the image's Python and torch.
#   bash tools/pack_flash_attn.sh          # here, once (~28 min on 2 cores); writes .flash/*.tar.xz (ignored)
#   FLASH_TAR=.flash/flash-attn-2.8.3.post2-sm90.tar.xz bash tools/gpu_check.sh flash ...
# One change to flash-attn's source: with FLASHATTENTION_DISABLE_BACKWARD its Python entry
# points for the backward pass refuse, but flash_api.cpp's run_mha_bwd still names every
# backward kernel; its body is compiled out here so that the module links without them.
set -euo pipefail
V=${FLASH_ATTN_VERSION:-2.8.3.post2}
SHA=${FLASH_ATTN_SHA256:-d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b}
TORCH=${TORCH_VERSION:-2.11.0}   # the device image's torch: its headers are what the kernels are built against
cd "$(dirname "$0")/.."
command -v nvcc > /dev/null || { echo "nvcc not found: a CUDA toolkit is needed (13.0 matches the GPU image's)"; exit 1; }
work=${WORK:-$(mktemp -d)}; mkdir -p "$work"
[ -n "${WORK:-}" ] || trap 'rm -rf "$work"' EXIT
if [ ! -d "$work/src" ]; then
  # (pip download builds an sdist's metadata, which needs CUDA_HOME and torch: fetch the file itself)
  url=$(curl -sSf https://pypi.org/simple/flash-attn/ | grep -o "https://[^\"#]*/flash_attn-$V.tar.gz" | head -1 || true)
  [ -n "$url" ] || { echo "PyPI has no flash_attn-$V.tar.gz (FLASH_ATTN_VERSION)"; exit 1; }
  curl -sSfL -o "$work/flash_attn-$V.tar.gz" "$url"
  echo "$SHA  $work/flash_attn-$V.tar.gz" | sha256sum -c --quiet - \
    || { echo "flash_attn-$V.tar.gz does not match sha256 $SHA (another version needs its FLASH_ATTN_SHA256)"; exit 1; }
  tar xzf "$work/flash_attn-$V.tar.gz" -C "$work" && mv "$work/flash_attn-$V" "$work/src"
fi
if [ ! -d "$work/torch/include" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work" "torch==$TORCH"
  python3 - "$work"/torch-"$TORCH"-*.whl "$work" <<'PY'   # its headers and version only
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("torch/include/") or n == "torch/version.py"])
PY
  rm "$work"/torch-"$TORCH"-*.whl
fi
tv=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$work/torch/version.py")
src=$work/src/csrc/flash_attn
FLAGS=(-DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_DROPOUT -DFLASHATTENTION_DISABLE_ALIBI -DFLASHATTENTION_DISABLE_SOFTCAP
       -DFLASHATTENTION_DISABLE_UNEVEN_K -DFLASHATTENTION_DISABLE_LOCAL)
# nvcc's flags as flash-attn's setup.py and torch's cpp_extension give them, for sm_90 alone
NVCC=(-I "$src" -I "$src/src" -I "$work/src/csrc/cutlass/include" -I "$work/torch/include" -I "$work/torch/include/torch/csrc/api/include"
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
      --expt-relaxed-constexpr --compiler-options -fPIC -O3 -std=c++17 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
      -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-extended-lambda --use_fast_math "${FLAGS[@]}"
      -gencode arch=compute_90,code=sm_90 --threads 1 -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=flash_attn_2_cuda -D_GLIBCXX_USE_CXX11_ABI=1)
mkdir -p "$work/objs"
export work src
compile() {  # one kernel file; kept across runs of a WORK folder
  local o=$work/objs/$(basename "$1" .cu).o
  [ -s "$o" ] && return 0
  nvcc -c "$src/src/$1" -o "$o.tmp" "${@:2}" 2> "$o.log" || { echo "FAILED $1 (log: $o.log)"; return 1; }
  mv "$o.tmp" "$o" && echo "  $1"
}
export -f compile
files=$(cd "$src/src" && ls flash_fwd_hdim*_sm80.cu flash_fwd_split_hdim*_sm80.cu)
echo "compiling $(echo "$files" | wc -w) kernel files for sm_90 against torch $tv ($(nproc) at a time)"
echo "$files" | xargs -P "$(nproc)" -I{} bash -c 'compile "$@"' _ {} "${NVCC[@]}"
# the package: objects, the binding's source (patched), the headers it includes, the Python side
pkg=$work/pkg/flash-attn-$V-sm90; rm -rf "$work/pkg"; mkdir -p "$pkg/csrc/flash_attn" "$pkg/csrc/cutlass"
cp "$work"/objs/*.o "$pkg/" && cp -r "$src/src" "$pkg/csrc/flash_attn/src" && rm -f "$pkg"/csrc/flash_attn/src/*.cu
cp -r "$work/src/csrc/cutlass/include" "$pkg/csrc/cutlass/include"
python3 - "$src/flash_api.cpp" "$pkg/csrc/flash_attn/flash_api.cpp" <<'PY'
import sys
s = open(sys.argv[1]).read()
head = "void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {\n"
body = s[s.index(head) + len(head):]
end = body.index("\n}\n")
assert head in s and "run_mha_bwd_<" in body[:end], "flash_api.cpp's run_mha_bwd is not as expected"
s = s.replace(head + body[:end], head + "#ifndef FLASHATTENTION_DISABLE_BACKWARD\n" + body[:end] + "\n#endif", 1)
open(sys.argv[2], "w").write(s)
PY
mkdir -p "$pkg/python/flash_attn" && cp "$work/src/flash_attn/__init__.py" "$work/src/flash_attn/flash_attn_interface.py" "$pkg/python/flash_attn/"
printf '%s\n' "flash-attn $V" "torch $tv" "flags ${FLAGS[*]}" > "$pkg/BUILD"
mkdir -p .flash
(cd "$work/pkg" && tar cf - "flash-attn-$V-sm90") | xz -6 -T2 > ".flash/flash-attn-$V-sm90.tar.xz"
ls -la ".flash/flash-attn-$V-sm90.tar.xz"
