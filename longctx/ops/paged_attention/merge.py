"""Merging split partials by log-sum-exp, in Triton: the pieces the decode kernel's in-launch
merge uses (`merge_range`, `store_rows`), the merge launch (`merge_kernel`) that the decode
and prefill launchers run after their splits, and the rules that shape it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import TRITON_OPTIONS
from .tuning import TUNE


@triton.jit
def lse_step(lse, o, m, den, acc):
    """One chunk of an online log-sum-exp merge over splits, the last axis of lse [..., S] (the
    chunk's natural-log LSEs) and the second last of o [..., S, D] (their normalized outputs):
    the running max m, denominator den [...] and unnormalized sum acc [..., D] rescaled to the
    new max and the chunk added. Returns (m, m_safe, den, acc), m_safe the max with -inf (no
    split seen yet) as 0."""
    m_new = tl.maximum(m, tl.max(lse, -1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    c = tl.exp(m - m_safe)
    w = tl.exp(lse - tl.expand_dims(m_safe, -1))
    den = den * c + tl.sum(w, -1)
    acc = acc * tl.expand_dims(c, -1) + tl.sum(o * tl.expand_dims(w, -1), -2)
    return m_new, m_safe, den, acc


@triton.jit
def merge_range(O, LSE, row0, n_splits, s0, count, stride, G: tl.constexpr, G_MERGE: tl.constexpr, MERGE_STEP: tl.constexpr, D: tl.constexpr):
    """The log-sum-exp merge of `count` partials of query rows row0 .. row0 + G - 1, those of
    splits s0, s0 + stride, ... (of n_splits a row in O [rows, n_splits, D] and LSE [rows,
    n_splits]), MERGE_STEP at a time (online, like the softmax): (out [G_MERGE, D], lse [G_MERGE]), itself a
    partial (normalized, with its natural-log LSE; -inf and 0 where no split saw a key).
    Partials are read past L1 (.cg): other programs wrote them."""
    offs_g = tl.arange(0, G_MERGE)
    offs_d = tl.arange(0, D)
    rows = row0 + offs_g
    gm = offs_g < G
    m = tl.full((G_MERGE,), float("-inf"), tl.float32)
    den = tl.zeros((G_MERGE,), tl.float32)
    acc = tl.zeros((G_MERGE, D), tl.float32)
    for i0 in range(0, count, MERGE_STEP):
        offs_i = i0 + tl.arange(0, MERGE_STEP)
        offs_s = s0 + offs_i * stride
        ms = gm[:, None] & (offs_i < count)[None, :]
        lse = tl.load(LSE + rows[:, None] * n_splits + offs_s[None, :], mask=ms, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(O + (rows[:, None, None] * n_splits + offs_s[None, :, None]) * D + offs_d[None, None, :],
                    mask=ms[:, :, None], other=0.0, cache_modifier=".cg")
        m, _, den, acc = lse_step(lse, o, m, den, acc)
    ok = den > 0
    out = tl.where(ok[:, None], acc / tl.where(ok, den, 1.0)[:, None], 0.0)
    return out, tl.where(ok, m + tl.log(tl.where(ok, den, 1.0)), float("-inf"))


@triton.jit
def store_rows(O, LSE, row0, n, s, out, lse, G: tl.constexpr, G_MERGE: tl.constexpr, D: tl.constexpr):
    """Rows row0 .. row0 + G - 1 of out [G_MERGE, D] and lse [G_MERGE] at slot s of n a row: O [rows,
    n, D] (in its dtype), LSE [rows, n]."""
    offs_g = tl.arange(0, G_MERGE)
    rows = row0 + offs_g
    gm = offs_g < G
    offs_d = tl.arange(0, D)
    tl.store(O + (rows[:, None] * n + s) * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=gm[:, None])
    tl.store(LSE + rows * n + s, lse, mask=gm)


@triton.jit
def _partials(X, b, hq, offs_s, smask, cols, s_o_b, s_o_h, s_o_s):
    """Splits offs_s (masked by smask; zeros past S) of (row b, query head hq)'s partials X at
    columns cols: [len(offs_s), len(cols)]."""
    return tl.load(X + b * s_o_b + hq * s_o_h + offs_s[:, None] * s_o_s + cols[None, :], mask=smask[:, None], other=0.0)


@triton.jit
def merge_head(O, LSE, OUT, LOUT, b, hq, cb, S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
               HQ: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr, SC: tl.constexpr, BD: tl.constexpr):
    """Merge the S splits of (row b, query head hq) by log-sum-exp, columns cb * BD .. (all D
    with BD 0): all S_PAD at once, or SC at a time with an online rescale where S_PAD is
    larger (SC > 0)."""
    DC: tl.constexpr = BD if BD > 0 else D  # this program's columns
    offs_d = tl.arange(0, DC)
    if BD > 0:
        offs_d += cb * BD
    if SC == 0 or S_PAD <= SC:
        offs_s = tl.arange(0, S_PAD)
        smask = offs_s < S
        lse = tl.load(LSE + b * s_l_b + hq * s_l_h + offs_s, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_safe)
        denom = tl.sum(w, 0)
        w = w / tl.where(denom > 0, denom, 1.0)
        o = _partials(O, b, hq, offs_s, smask, offs_d, s_o_b, s_o_h, s_o_s)
        out = tl.sum(o * w[:, None], 0)
    else:
        m_safe = 0.0
        m = float("-inf")
        denom = 0.0
        acc = tl.zeros((DC,), tl.float32)
        for s0 in range(0, S, SC):
            offs_s = s0 + tl.arange(0, SC)
            smask = offs_s < S
            lse = tl.load(LSE + b * s_l_b + hq * s_l_h + offs_s, mask=smask, other=float("-inf"))
            o = _partials(O, b, hq, offs_s, smask, offs_d, s_o_b, s_o_h, s_o_s)
            m, m_safe, denom, acc = lse_step(lse, o, m, denom, acc)
        out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + b * s_out_b + hq * s_out_h + offs_d, out.to(OUT.dtype.element_ty))
    lout = tl.where(denom > 0, m_safe + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))
    if BD > 0:
        tl.store(LOUT + b * HQ + hq, lout, mask=cb == 0)  # one column block writes it
    else:
        tl.store(LOUT + b * HQ + hq, lout)


@triton.jit(do_not_specialize=["S", "s_o_b", "s_o_h", "s_o_s", "s_l_b", "s_l_h"])
def merge_kernel(O, LSE, OUT, LOUT, S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
                 HQ: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr, SC: tl.constexpr = 0, BD: tl.constexpr = 0):
    """Merge the splits of one (row, query head) by log-sum-exp (`merge_head`): the merge
    launch (S_PAD compiles a variant per power of two of splits). SC > 0 reads the splits SC
    at a time where S_PAD is larger; else all at once. BD > 0 (`merge_cols`): the program
    merges BD of the D columns, program_id(1) which (grid (rows * HQ, D // BD)); 0: all D."""
    pid = tl.program_id(0)
    merge_head(O, LSE, OUT, LOUT, pid // HQ, pid % HQ, tl.program_id(1), S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
               HQ, D, S_PAD, SC, BD)


_COUNTERS: dict = {}


def counters(device, n: int) -> torch.Tensor:
    """Per-device int32 zeros, one per (row, KV head) (or per group of splits): the in-kernel
    merge's finished-split counts. Each merge sets its counter back to 0, so the buffer is
    reused across calls (and CUDA graph replays) without clearing; one stream at a time uses it."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def merge_mode(capturing: bool) -> str:
    """How a decode call's splits merge (TUNE["merge"], checked): "kernel" (the last split of
    each head merges inside the decode launch: one launch less, ~20 us of host time a call) or
    "launch" (a second, parallel merge kernel: less GPU time); "auto" takes "launch" under CUDA
    graph capture, whose launches cost no host time on replay, else "kernel"."""
    option = TUNE["merge"]
    if option not in ("auto", "kernel", "launch"):
        raise ValueError(f"TUNE['merge'] must be 'auto', 'kernel' or 'launch', got {option!r}")
    if option == "auto":
        return "launch" if capturing else "kernel"
    return option


def merge_tree(splits: int) -> int:
    """Splits a group of the in-kernel merge (0: the last split merges them all):
    TUNE["merge_tree"] from TUNE["merge_tree_from"] splits on (docs/kernels.md)."""
    g = TUNE["merge_tree"]
    return g if g and splits >= TUNE["merge_tree_from"] else 0


def merge_cols(D: int, heads: int, sm: int) -> int:
    """Columns a program of the merge launch (0: all D): blocks of TUNE["merge_cols"] while the
    `heads` (rows x query heads) programs times the blocks stay within one per SM. Batch 1 of
    Llama-3's 32 heads leaves 100 of the H200's 132 SMs idle with one program a head; four
    blocks of 32 columns fill 128."""
    c = TUNE["merge_cols"]
    if not c or c >= D:
        return 0
    n = D // c
    while n > 1 and heads * n > sm:
        n //= 2
    return D // n if n > 1 else 0


def merge_shape(B: int, Hq: int, D: int, sm: int, splits: int) -> dict:
    """The merge launch's compile-time shape (`merge_head`): splits padded to a power of two,
    read TUNE["merge_chunk"] at a time, in blocks of BD columns (`merge_cols`; 0: all)."""
    return dict(S_PAD=max(2, triton.next_power_of_2(splits)), SC=TUNE["merge_chunk"], BD=merge_cols(D, B * Hq, sm))


def merge_launch(o, lse, out, lout, S: int, merge: dict) -> None:
    """The merge launch (`merge_kernel`): the S partials a (row, query head) of o [B, H_q, S,
    D] and lse [B, H_q, S] into out [B, H_q, 1, D] and lout [B, H_q, 1], in `merge`'s shape."""
    B, Hq, _, D = o.shape
    merge_kernel[(B * Hq, D // merge["BD"] if merge["BD"] else 1)](
        o, lse, out, lout, S, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HQ=Hq, D=D, **merge, num_warps=4, **TRITON_OPTIONS)
