#!/usr/bin/env bash
# Pack a Triton release for the GPU machine, whose image has its own (3.6) and no registry:
# the manylinux wheel for its Python (3.12), with libtriton.so's debug sections stripped and the
# parts a Triton kernel launch does not load left out (CUPTI, the ptxas sm_90 does not run, proton, the
# instrumentation test library, AMD's code generator), as one tar.xz under the one carry's 64 MiB
# (3.8.0: 248 MB wheel -> 55 MB; 3.9.0 -> 59 MB). On the device:
#   TRITON_TAR=.triton/triton-3.8.0.tar.xz bash tools/gpu_check.sh ...
#   bash tools/pack_triton.sh 3.8.0        # here, once; writes .triton/triton-3.8.0.tar.xz (ignored)
# torch's CUDA wheels pin their Triton: 2.12.0 -> 3.7.0, 2.13.0 -> 3.7.1, 2.14.1 -> 3.8.0 (pip's
# resolver, 2026-12-03), 2.15.0 -> ~=3.9.0 (its wheel's METADATA, 2026-12-04); the image's torch
# 2.11 has 3.6.
set -euo pipefail
V=${1:?usage: pack_triton.sh VERSION}
cd "$(dirname "$0")/.."
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "triton==$V"
mkdir "$work/tree" && (cd "$work/tree" && python3 -m zipfile -e "$work"/triton-"$V"-*.whl .)
t=$work/tree/triton
strip --strip-unneeded "$t/_C/libtriton.so"
chmod +x "$t"/backends/*/bin/*   # (zipfile drops the wheel's modes: ptxas must run)
# (3.9 ships AMD's code generator as its own 100 MB library, loaded only to compile for AMD)
# Of its two ptxas, keep the one an sm_90 compile runs: 3.8 takes ptxas-blackwell from sm_100 on,
# 3.9 from sm_90 on (a 3.9 pack without it failed every compile on the H200: "Cannot find
# ptxas-blackwell"). Asked of the release's own get_ptxas, run with stand-in knobs.
hopper=$(python3 - "$t/backends/nvidia/compiler.py" <<'PY'
import ast, sys, types
tree = ast.parse(open(sys.argv[1]).read())
fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_ptxas")
fn.returns = None
for a in fn.args.args:
    a.annotation = None
tools = types.SimpleNamespace(ptxas="ptxas", ptxas_blackwell="ptxas-blackwell")
scope = {"knobs": types.SimpleNamespace(nvidia=tools)}
exec(compile(ast.Module([fn], []), "get_ptxas", "exec"), scope)
print(scope["get_ptxas"](90))
PY
)
case $hopper in ptxas) drop=ptxas-blackwell ;; ptxas-blackwell) drop=ptxas ;; *) echo "get_ptxas(90) gave '$hopper'"; exit 1 ;; esac
echo "sm_90 compiles with $hopper; leaving out $drop"
rm -rf "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" "$t/backends/nvidia/bin/$drop" \
  "$t/_C/libproton.so" "$t"/instrumentation/*.so "$t/backends/amd/lib/libtriton_amd_codegen.so"
mkdir -p .triton
(cd "$work/tree" && tar cf - triton triton-"$V".dist-info) | xz -6 -T2 > ".triton/triton-$V.tar.xz"
ls -la ".triton/triton-$V.tar.xz"
