"""bf16 decode on the GPU: the triton kernel's error against the fp64 oracle next to the
reference path's, per K/V variant (k16, v16), on SmolLM2's and Llama-3's shapes.

Usage (GPU machine, repo root): python3 scripts/diag_bf16.py
"""
import sys

import torch

sys.path.insert(0, ".")
from longctx import KVConfig  # noqa: E402
from longctx.ops.paged_attention import paged_attention  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402
from longctx.testing import attention_fp64, expected_dense  # noqa: E402
from tests.ops.test_paged_attention import fill  # noqa: E402
from tests.ops.test_paged_attention_triton import _to  # noqa: E402

DEFAULT = dict(K.TUNE)
for Hq, H, D, T in ((9, 3, 64, 700), (32, 8, 128, 3000)):
    for bits in (4, 8, 16):
        cfg = KVConfig(bits=bits, block_size=64)
        cache, k, v = fill(cfg, 1, T, 1, H, D, dtype=torch.bfloat16, seed=T)
        view = _to(cache.view(0), "cuda")
        q = torch.randn(1, Hq, 1, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=T - 1)
        exact, _ = attention_fp64(q, k_exp, v_exp, None)
        ref, _ = paged_attention(q.cuda(), view, backend="reference")
        e_ref = (ref.cpu().double() - exact).abs().max().item()
        for tune in ({"k16": 2}, {"k16": 3}, {"k16": 3, "v16": 2}, {"k16": 0, "v16": False}):
            K.TUNE.clear()
            K.TUNE.update(DEFAULT, **tune)
            out, _ = paged_attention(q.cuda(), view, backend="triton")
            e = (out.cpu().double() - exact).abs().max().item()
            d = (out.float() - ref.float()).abs().max().item()
            print(f"H{Hq}/{H} D{D} T{T} bits{bits} {tune}: triton err {e:.2e}, reference err {e_ref:.2e}, |triton - reference| {d:.2e}", flush=True)
