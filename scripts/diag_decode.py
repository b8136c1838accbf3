"""Locate a decode-kernel mismatch: error of the Triton kernel vs the fp64 oracle, per variant."""
import itertools, sys
import torch
sys.path.insert(0, ".")
from longctx import KVConfig
from longctx.ops.paged_attention.triton import paged_decode_triton
from longctx.testing import attention_fp64, expected_dense
from tests.ops.test_paged_attention import fill
from tests.ops.test_paged_attention_triton import _to

for dtype, (B, T, Hq, Hkv, P, kw, pad) in itertools.product(
    [torch.float16, torch.bfloat16, torch.float32],
    [(1, 10, 4, 4, 16, dict(bits=16), False), (1, 10, 3, 1, 16, dict(bits=16), False), (2, 10, 3, 1, 16, dict(bits=16), False),
     (1, 40, 3, 1, 16, dict(bits=16), False), (1, 40, 3, 1, 16, dict(bits=4), False), (1, 40, 3, 1, 16, dict(bits=4, sink_blocks=0), False),
     (2, 63, 9, 3, 16, dict(bits=4), False), (2, 63, 9, 3, 16, dict(bits=4), True), (1, 63, 4, 1, 16, dict(bits=4), True),
     (1, 600, 3, 1, 256, dict(bits=4), False), (1, 300, 4, 4, 16, dict(bits=2, rotate=True), True)]):
    cfg = KVConfig(block_size=P, **kw)
    D = 128 if P == 256 else 64
    cache, k, v = fill(cfg, B, T, 1, Hkv, D, dtype=dtype, seed=T)
    q = torch.randn(B, Hq, 1, D).to(dtype)
    start = torch.tensor([min(4 * b + 1, T - 1) for b in range(B)], dtype=torch.int32) if pad else None
    for sp in (1, 2):
        out, lse = paged_decode_triton(q.cuda(), _to(cache.view(0), "cuda"), start.cuda() if pad else None, D**-0.5, splits=sp)
        ex, exl = attention_fp64(q, *expected_dense(k, v, cfg, sealed_tokens=T - 1), start)
        err = (out.cpu().double() - ex).abs().max().item()
        print(f"{str(dtype)[6:]:9s} B{B} T{T} P{P} D{D} H{Hq}/{Hkv} {cfg.describe():5s} sink{cfg.sink_blocks} pad{int(pad)} splits{sp}: err {err:.2e}", "  <-- BAD" if err > 0.05 else "")
