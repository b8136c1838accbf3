"""Drive one decode-kernel case for Nsight Compute: where the kernel's time goes (stall
reasons per SASS instruction, DRAM throughput, occupancy), which graph timing cannot say.

Usage (GPU machine, repo root), e.g. int4 at 128k, batch 1, Llama-3-8B shape:
  ncu --clock-control none -k regex:_decode_kernel --launch-skip 3 --launch-count 1 \
      --set full -o /tmp/dec python3 scripts/prof_decode.py int4 131072 1
  ncu -i /tmp/dec.ncu-rep --page details > details.txt
  ncu -i /tmp/dec.ncu-rep --page source --csv --print-source sass > sass.csv
`bash scripts/device_check.sh prof` does this for int4 at 128k and 4k and writes both to $OUT.
Args: format (int4, int8, bf16), context tokens, batch, then any TUNE overrides as KEY=VALUE
(Python literals; e.g. merge='launch' for the kernel variant CUDA graphs run); the view is the
bench's synthetic one.
"""
import sys

import torch

sys.path.insert(0, ".")
from longctx import KVConfig
from longctx.bench import synthetic_view
from longctx.ops.paged_attention import paged_attention
from longctx.ops.paged_attention import triton as K
from scripts.diag_parts import overrides

fmt, T, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
K.TUNE.update(overrides(sys.argv[4:]))
bits = {"int4": 4, "int8": 8, "bf16": 16}[fmt]
Hq, H, D = 32, 8, 128
view = synthetic_view(B, T, H, D, KVConfig(bits=bits, block_size=64), "cuda")
q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
for _ in range(5):  # the first calls compile; ncu skips them (--launch-skip)
    paged_attention(q, view, backend="triton", return_lse=False)
torch.cuda.synchronize()
print("done", fmt, T, B)
