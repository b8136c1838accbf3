"""Which triton ops compile and match the reference at head_dim 32 on this GPU (resolve_backend's
"auto" picks triton for any power-of-two head_dim >= 16). Prints one line a case.

Usage (GPU machine, repo root): python3 scripts/diag_dim32.py
"""
import sys

import torch

sys.path.insert(0, ".")
from longctx import KVConfig  # noqa: E402
from longctx.cache import PagedKVCache  # noqa: E402
from longctx.ops.gather_dequant import gather_dequant  # noqa: E402
from longctx.ops.paged_attention import paged_attention  # noqa: E402
from longctx.testing import random_kv  # noqa: E402


def case(kw, dtype, D, T, G):
    cfg = KVConfig(block_size=16, **kw)
    cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=D)
    k, v = random_kv(2, 2, T, D, dtype=dtype, seed=1)
    cache.append(0, k.cuda(), v.cuda())
    cache.seal()
    cache.append(0, k[:, :, :1].cuda(), v[:, :, :1].cuda())
    q = torch.randn(2, 2 * G, 1, D, dtype=dtype, device="cuda")
    out = []
    for what, fn in (("decode", lambda b: paged_attention(q, cache.view(0), backend=b)[0].float()),
                     ("gather", lambda b: gather_dequant(cache.view(0), out_dtype=torch.float32, backend=b)[0])):
        try:
            a, r = fn("triton"), fn("reference")
            out.append(f"{what} ok {(a - r).abs().max().item():.2e}")
        except Exception as e:  # noqa: BLE001
            out.append(f"{what} FAILS {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    return "; ".join(out)


for D in (32, 64):
    for kw in (dict(bits=4), dict(bits=8), dict(bits=2, rotate=True), dict(bits=16), dict(bits=4, k_bits=8)):
        for dtype in (torch.float32, torch.bfloat16):
            for T, G in ((70, 4), (700, 4), (700, 12)):
                print(f"D={D} {kw} {str(dtype)[6:]} T={T} G={G}: {case(kw, dtype, D, T, G)}", flush=True)
