"""Shared by tests and notebooks: input factories, fp64 oracles and error-budget asserts.

The oracles here are written independently of the library's ops (plain loops over rows,
per-block quantization straight from quant.py), so a test compares two different paths.
"""

from __future__ import annotations

import torch

from .config import KVConfig
from .quant import dequantize_k, dequantize_v, quantize_k, quantize_v, rotate, rotate_to_seal


def random_kv(batch: int, heads: int, tokens: int, dim: int, *, dtype=torch.float32, seed: int = 0, outliers: bool = True):
    """Keys/values [B, H, T, D] shaped like real ones: keys with a few large-offset
    channels (the reason K is quantized per channel), values roughly unit scale."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, tokens, dim, generator=g)
    v = torch.randn(batch, heads, tokens, dim, generator=g)
    if outliers:
        chans = torch.randperm(dim, generator=g)[: max(1, dim // 16)]
        k[..., chans] = k[..., chans] * 4 + 8
    return k.to(dtype), v.to(dtype)


def expected_dense(k: torch.Tensor, v: torch.Tensor, cfg: KVConfig, layer: int = 0, sealed_tokens: int | None = None):
    """What a paged cache holding k, v [B, H, T, D] (appended to one layer) must read back:
    sink blocks and the tail exact, every other full block that lies inside the first
    `sealed_tokens` tokens (default: all) quantized on its own. A cache seals, when a step
    starts, the full blocks of everything appended before it: after a last chunk of C
    tokens, sealed_tokens = T - C. Built block by block from quant.py, without the cache,
    tables or ops."""
    cfg = cfg.resolve(layer + 1, k.shape[-1])
    kb, vb = cfg.layer_bits(layer)
    P, T = cfg.block_size, k.shape[2]
    ko, vo = k.clone(), v.clone()
    sealed = T if sealed_tokens is None else sealed_tokens
    for j in range(sealed // P):
        if j < cfg.sink_blocks:
            continue
        sl = slice(j * P, (j + 1) * P)
        kk, vv = k[:, :, sl], v[:, :, sl]
        if kb != 16:
            kr = rotate_to_seal(kk) if cfg.rotate else kk
            deq = dequantize_k(*quantize_k(kr, kb, k.dtype, cfg.key_span), kb, torch.float32)
            ko[:, :, sl] = (rotate(deq) if cfg.rotate else deq).to(k.dtype)
        if vb != 16:
            vr = rotate_to_seal(vv) if cfg.rotate else vv
            deq = dequantize_v(*quantize_v(vr, vb, cfg.group_size, v.dtype), vb, cfg.group_size, torch.float32)
            vo[:, :, sl] = (rotate(deq) if cfg.rotate else deq).to(v.dtype)
    return ko, vo


def attention_fp64(q, k, v, start=None, scale=None):
    """Causal attention in fp64 by explicit loops over rows and query heads.

    q [B, H_q, C, D] are the last C positions of k, v [B, H_kv, T, D]; row b sees keys from
    start[b]. Returns (out [B, H_q, C, D], lse [B, H_q, C]) in fp64; a query that sees no key
    gets out 0 and lse -inf."""
    B, Hq, C, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(B, Hq, C, D, dtype=torch.float64)
    lse = torch.full((B, Hq, C), float("-inf"), dtype=torch.float64)
    for b in range(B):
        s0 = 0 if start is None else int(start[b])
        for h in range(Hq):
            kh, vh = k[b, h // (Hq // Hkv)].double(), v[b, h // (Hq // Hkv)].double()
            for i in range(C):
                pos = T - C + i
                if s0 > pos:
                    continue
                scores = (kh[s0 : pos + 1] @ q[b, h, i].double()) * scale
                m = torch.logsumexp(scores, 0)
                lse[b, h, i] = m
                out[b, h, i] = torch.softmax(scores, 0) @ vh[s0 : pos + 1]
    return out, lse


def flash_kvcache_standin(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, causal=False, return_softmax_lse=False, **unused):
    """flash-attn's `flash_attn_with_kvcache` as its docstring defines it (no new k/v, rotary,
    windows or softcap), in torch fp32, for testing the `flash` backend where flash-attn
    cannot run (the CPU; tests/test_cuda.py holds it to the kernel where flash-attn imports).
    q [B, Sq, H_q, D] fp16/bf16; k_cache/v_cache [B, S, H_kv, D], or
    with block_table [pages, page_size, H_kv, D] with page_size a multiple of 256 and
    block_table int32 [B, pages per row]; cache_seqlens int32 [B]: row b reads its first
    cache_seqlens[b] tokens only. causal: the mask aligned to the bottom right (query i sees
    keys j <= i + seqlen_k - Sq). A query that sees no key gets a zero output; its LSE is left
    NaN (flash-attn does not define it), so a caller must not read it."""
    if unused:
        raise NotImplementedError(f"flash_kvcache_standin: {sorted(unused)} are not modelled")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise AssertionError("k_cache and v_cache must have contiguous last dimension")
    B, Sq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if block_table is not None:
        if k_cache.shape[1] % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")
        if block_table.dtype != torch.int32:
            raise RuntimeError("block_table must have dtype torch.int32")
    if cache_seqlens is not None and cache_seqlens.dtype != torch.int32:
        raise RuntimeError("cache_seqlens must have dtype int32")
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32, device=q.device)
    for b in range(B):
        if block_table is None:
            n = k_cache.shape[1] if cache_seqlens is None else int(cache_seqlens[b])
            k, v = k_cache[b, :n], v_cache[b, :n]
        else:
            n = int(cache_seqlens[b])
            ids = block_table[b, : -(-n // k_cache.shape[1])].long()
            k, v = k_cache[ids].flatten(0, 1)[:n], v_cache[ids].flatten(0, 1)[:n]
        k, v = k.float().repeat_interleave(Hq // Hkv, 1), v.float().repeat_interleave(Hq // Hkv, 1)  # [n, H_q, D]
        s = torch.einsum("qhd,khd->hqk", q[b].float(), k) * scale
        if causal:
            allowed = torch.arange(n, device=q.device)[None, :] <= torch.arange(Sq, device=q.device)[:, None] + n - Sq
            s = s.masked_fill(~allowed, float("-inf"))
        seen = torch.isfinite(s).any(-1)  # [H_q, Sq]
        p = torch.softmax(torch.where(seen[..., None], s, 0.0), -1) * seen[..., None]
        out[b] = torch.einsum("hqk,khd->qhd", p, v)
        lse[b] = torch.where(seen, torch.logsumexp(s, -1), float("nan"))
    out = out.to(q.dtype)
    return (out, lse) if return_softmax_lse else out


def assert_close_fp64(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Finite-aware closeness against an fp64 oracle with a message quoting the worst error."""
    a, e = actual.double(), expected.double()
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    err = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    bound = atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
    bad = ~(err <= bound)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off; worst |err|={err.max().item():.3g}, "
            f"first at {idx}: got {a[idx].item():.6g}, expected {e[idx].item():.6g} (atol={atol}, rtol={rtol})"
        )


def tiny_llama(*, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 32, vocab: int = 128, seed: int = 0, **overrides):
    """A random-initialized LlamaForCausalLM small enough for unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        **overrides,
    )
    return LlamaForCausalLM(cfg).eval()
