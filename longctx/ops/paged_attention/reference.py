"""Eager torch definition of paged attention: gather + dequantize into dense, then exact
softmax attention in fp32 with the causal offset, GQA and left padding. Returns LSE too."""

from __future__ import annotations

import torch

from ..gather_dequant.reference import gather_dequant_reference
from ..pages import PagedView

QUERY_SLICE = 512  # queries per slice, bounds the [C, T] score matrix in memory


def paged_attention_reference(q, view: PagedView, start, scale, return_lse: bool = True):
    k_past, v_past = gather_dequant_reference(view, torch.float32)
    k = torch.cat([k_past, view.tail_k.float()], dim=2)
    v = torch.cat([v_past, view.tail_v.float()], dim=2)
    return attention_reference(q, k, v, start, scale, return_lse, causal=view.tail_k.shape[2] > 0)


def attention_reference(q, k, v, start, scale, return_lse: bool = True, causal: bool = True):
    """Exact attention in fp32. Query i of C sits at position T - C + i and sees keys
    start[b] .. T - C + i (causal=False: every query sees keys start[b] .. T - 1). The G
    query heads of a KV head are stacked along the query axis so K/V are never repeated."""
    B, Hq, C, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    kf, vf = k.float(), v.float()
    qf = q.float().reshape(B, Hkv, G * C, D)
    key_pos = torch.arange(T, device=q.device)
    first = torch.zeros(B, dtype=torch.long, device=q.device) if start is None else start.long()
    outs, lses = [], []
    for c0 in range(0, C, QUERY_SLICE):
        c1 = min(C, c0 + QUERY_SLICE)
        q_pos = torch.arange(T - C + c0, T - C + c1, device=q.device) if causal else torch.full((c1 - c0,), T - 1, device=q.device)
        # visible[b, i, j]: key j is at or after the row's first token and not after query i
        visible = (key_pos[None, None, :] <= q_pos[None, :, None]) & (key_pos[None, None, :] >= first[:, None, None])
        seen = visible.any(-1)  # [B, c]: queries that see at least one key
        mask = (visible | ~seen[..., None])[:, None, None].expand(B, 1, G, c1 - c0, T).reshape(B, 1, G * (c1 - c0), T)
        qs = qf.reshape(B, Hkv, G, C, D)[:, :, :, c0:c1].reshape(B, Hkv, G * (c1 - c0), D)
        out = torch.nn.functional.scaled_dot_product_attention(qs, kf, vf, attn_mask=mask, scale=scale)
        out = out.reshape(B, Hkv, G, c1 - c0, D) * seen[:, None, None, :, None]
        outs.append(out)
        if return_lse:
            s = torch.einsum("bhcd,bhtd->bhct", qs, kf) * scale
            s = s.masked_fill(~mask, float("-inf")).reshape(B, Hkv, G, c1 - c0, T)
            lse = torch.logsumexp(s, dim=-1)
            lses.append(torch.where(seen[:, None, None], lse, float("-inf")))
    out = torch.cat(outs, dim=3).reshape(B, Hq, C, D).to(q.dtype)
    lse = torch.cat(lses, dim=3).reshape(B, Hq, C) if return_lse else None
    return out, lse


def merge_partials(parts):
    """Log-sum-exp merge of partial attentions [(out [B, H, C, D], lse [B, H, C])] over
    disjoint key sets, in fp32. A part's rows with a -inf LSE saw no key and weigh nothing
    (their output is ignored, NaN included); rows no part saw stay zero with a -inf LSE."""
    lses = torch.stack([lse.float() for _, lse in parts])
    mx = lses.amax(0)
    safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    w = torch.exp(lses - safe)
    denom = w.sum(0)
    norm = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = sum(torch.where(wi[..., None] > 0, o.float() * (wi / norm)[..., None], 0.0) for (o, _), wi in zip(parts, w))
    lse = torch.where(denom > 0, safe + torch.log(norm), torch.full_like(denom, float("-inf")))
    return out, lse
