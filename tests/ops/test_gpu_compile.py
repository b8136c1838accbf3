"""The decode and prefill kernels compiled on a machine without a GPU, for the H200 (sm_90) and
for the cards users have (sm_80 A100, sm_86 RTX 3090, sm_89 RTX 4090), in variants whose code
the CPU interpreter runs but does not hold to the GPU compiler's rules:
- the interpreter took a tensor-core dot of 8 columns (int2 at head_dim 64 split into two dots
  a sub-tile), which the compiler refuses (a dot needs K >= 16);
- the H200 took int4 codes converted to bf16 by a bf16x2 subtract, which PTX has only from
  sm_90 on: the int4 prefill kernel and the 2-D decode loop, where they take bf16 codes,
  failed to compile for RTX 30 and 40 cards.
tools/compile_kernels.py compiles the kernel as the launcher does (ptxas ships in the triton
wheel); these runs check that it compiles and that its shared memory fits the target's limit
a block (99 KiB on sm_86 and sm_89; the prefill kernel over pages of 256 tokens fits there in
tiles of 128, `prefill_tile`, and fp32 decode over 16-bit ones in tiles of 64, `loop_tile`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
VARIANTS = {
    "int2+rot-D64": ["--bits", "2", "--rotate", "--head-dim", "64"],  # two bytes' codes joined: 16 columns a dot
    "int2+rot-D128": ["--bits", "2", "--rotate"],  # a word's bytes in two dots of 16 columns
    "int2+rot-span16": ["--bits", "2", "--rotate", "--k-span", "16"],  # the named int2+rot: tiles of 16 tokens, a K scale row each
    "prefill-int2+rot-span16": ["--prefill", "128", "--bits", "2", "--rotate", "--k-span", "16", "--warps", "8"],  # tiles over 4 spans
    "int4+rot-D128": ["--bits", "4", "--rotate"],  # the queries and the output rotated in the program
    "int4+rot-D64-rows2": ["--bits", "4", "--rotate", "--head-dim", "64", "--rows", "2"],  # a prompt's beams' launch
    "int8-kernel-merge": ["--bits", "8", "--merge", "kernel"],  # eager calls merge in the launch
    # the prefill kernel (the same tiles, 128 query rows a program) rotating its queries and output
    "prefill-int2+rot-D128": ["--prefill", "128", "--bits", "2", "--rotate", "--warps", "8"],
    # consumer cards: int4 codes as bf16 (the 2-D loop over a 16-bit side, the prefill kernel), the side loop
    "k4v16-2d-sm86": ["--arch", "86", "--bits", "4", "--v-bits", "16", "--stages", "3"],
    "int4-side-sm86": ["--arch", "86", "--bits", "4"],
    "prefill-int4-sm89": ["--arch", "89", "--prefill", "128", "--bits", "4", "--warps", "8"],
    "prefill-int8-sm86": ["--arch", "86", "--prefill", "128", "--bits", "8", "--warps", "8"],
    "int4+rot-side-sm80": ["--arch", "80", "--bits", "4", "--rotate"],
    # pages of 256 tokens on a 4090: the 2-D decode loop over a 16-bit side fits in one stage (two: 155,648 bytes)
    "2d-k16v4-P256-sm89": ["--arch", "89", "--bits", "16", "--v-bits", "4", "--block-size", "256", "--stages", "1"],
    # fp32 queries over 16-bit pages of 256 tokens: whole pages need 155,712 bytes in one stage, tiles of 64 (the loop's, its sinks' and tail's) 78,080
    "2d-fp32-P256-tile64-sm89": ["--arch", "89", "--bits", "16", "--block-size", "256", "--stages", "1", "--dtype", "fp32", "--tile", "64"],
    # and the prefill kernel: a whole page needs 131,072 bytes in one stage, tiles of 128 fit
    "prefill-int4-P256-tile128-sm89": ["--arch", "89", "--prefill", "128", "--bits", "4", "--stages", "1", "--warps", "8",
                                       "--block-size", "256", "--tile", "128"],
}


@pytest.mark.skipif(not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists(), reason="the triton wheel has no ptxas/cuobjdump")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_compiles_for_the_gpu(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (conftest sets it for this process)
    p = subprocess.run([sys.executable, "tools/compile_kernels.py", *VARIANTS[name]], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "instructions per warp and step" in p.stdout, p.stdout[-2000:]
