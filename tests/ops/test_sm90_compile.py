"""The decode kernel (and the prefill kernel) compiled for the H200 (sm_90) on a machine without a
GPU, for variants whose code the CPU interpreter runs but does not hold to the GPU compiler's
rules: the interpreter took a tensor-core dot of 8 columns (int2 at head_dim 64 split into two
dots a sub-tile), which the compiler refuses (a dot needs K >= 16). scripts/sass_decode.py
compiles the kernel as the launcher does (ptxas ships in the triton wheel); these runs only
check that it compiles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIDE = ["--wp", "1", "--g-pad", "4", "--stages", "2", "--merge", "launch", "--k16", "1", "--svt", "1", "--group-size", "64", "--skip", "1",
        "--tiny", "1"]
VARIANTS = {
    "int2+rot-D64": ["--bits", "2", "--rotate", "--head-dim", "64", *SIDE],  # two bytes' codes joined: 16 columns a dot
    "int2+rot-D128": ["--bits", "2", "--rotate", *SIDE],  # a word's bytes in two dots of 16 columns
    "int4+rot-D128": ["--bits", "4", "--rotate", *SIDE],  # the queries and the output rotated in the program
    "int4+rot-D64-rows2": ["--bits", "4", "--rotate", "--head-dim", "64", "--rows", "2", *SIDE],  # a prompt's beams' launch
    # the prefill kernel (the same tiles, 128 query rows a program) rotating its queries and output
    "prefill-int2+rot-D128": ["--prefill", "128", "--bits", "2", "--rotate", "--group-size", "64", "--stages", "2", "--warps", "8"],
}


@pytest.mark.skipif(not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists(), reason="the triton wheel has no ptxas/cuobjdump")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_kernel_compiles_for_sm90(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (conftest sets it for this process)
    p = subprocess.run([sys.executable, "scripts/sass_decode.py", *VARIANTS[name]], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "instructions per warp and step" in p.stdout, p.stdout[-2000:]
