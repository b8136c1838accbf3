"""A Gluon page walk with the int4 side loop's arithmetic, to time the route of notes v24 on the H200
(which it closed: with the scales, `attend`, it is slower than the Triton kernel).

One one-warp program per (KV head, split) walks its split of the bench's int4 pages (shared
pool, shuffled block table) in a loop that owns its copies: NBUF shared-memory buffers, each
page's copies (K and V codes, K's and V's scales and zeros: 9 KB at 64 tokens, head_dim 128)
issued NBUF - 1 pages ahead. Per page it does what the decode kernel's side loop does with the
codes: K's nibbles to fp16 (1024 + c, 1024 + 16c: LOP3s, no layout change) as the second
operand of [16 query rows, 128] x [128, 64 tokens], an online base-2 softmax, V's nibbles from
transposing shared-memory loads (ldmatrix .trans) as the second operand of the probabilities'
dot. `walk` leaves out the scales' arithmetic (the copies are made), so it is a floor for such
a loop: its result is checked against an fp64 torch emulation of that arithmetic (a zero query,
then a random one). `attend` (--ab ATTEND=True) adds the scales and zero points as the side
loop applies them and is checked against fp64 attention over the dequantized pages (its V
codes are biased by 1024, taken out at the end: at 62 pages a program that leaves 3e-3, which
the kernel's exact V codes avoid). Both are sealed pages only: no sinks, tail, padding or
merge. Both are timed as the bench times (CUDA-graph replays over enough
copies of the pool to defeat L2) against the decode call (Triton kernel and merge launch) on
the same pages. Gluon is triton 3.6's (the GPU image's); the CPU interpreter does not run it.

  PYTHONPATH=/tmp/t36 python3 scripts/gluon_walk.py --sass   # compile for sm_90 without a GPU, count the loop's SASS
  python3 scripts/gluon_walk.py --nbuf 2 3                   # on the GPU: check, then time against the decode call
  python3 scripts/gluon_walk.py --nbuf 2 --ab G=16 QVEC=True --rounds 2   # option sets of the walk, in turn
  python3 scripts/gluon_walk.py --nbuf 2 --ab ATTEND=True "ATTEND=True,F16=True"   # with the scales (attend), bf16 and fp16
"""
import argparse
import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
DA = gl.constexpr(gl.DotOperandLayout(0, MMA.value, 2))
DB = gl.constexpr(gl.DotOperandLayout(1, MMA.value, 2))
WL = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))  # [64 tokens, 32 int16 words]: lane (g, t) token g (+8j), words 8t..8t+7
SL = gl.constexpr(gl.BlockedLayout([8], [32], [1], [0]))  # 256-byte scale pieces, 16 bytes a lane
SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
SH1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
VL = gl.constexpr(gl.BlockedLayout([2, 2], [32, 1], [1, 1], [1, 0]))  # [64 tokens, 2 groups] of V scales or zeros, 8 bytes a lane
# K's scales and zeros (per channel) loaded in channel order so that, put in the K dot's k
# order (logical_k), they lie where the dots' operands hold k: lane bits k + 2, k + 4 and
# register bits k + 1, 8, 16, 32, 64 (channels 32, 64; 4, 2, 1, 8, 16)
XK = gl.constexpr(gl.DistributedLinearLayout([[4], [2], [1], [8], [16]], [[32], [64], [0], [0], [0]], [], [], [128]))
# V's scales or zeros [64 tokens, 2 groups] loaded so that each group, split off, lies as the
# scores' columns (tokens) do: register bit token + 1, lane bits token + 2, 4, registers 8, 16, 32
SV2 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [1, 0], [8, 0], [16, 0], [32, 0]], [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [], [], [64, 2]))
# an int16 word's four nibbles of two words (one 32-bit register) -> fp16 pairs 1024 + c (even
# nibbles) and 1024 + 16c (odd ones)
NIB = gl.constexpr("{ .reg .b32 t; lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xea; lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xea; "
                   "shr.b32 t, $4, 8; lop3.b32 $2, t, 0x000F000F, 0x64006400, 0xea; lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xea; }")


@gluon.jit
def _issue(KC, VC, KS, KZ, VS, VZ, ks, vs, s0, s1, s2, s3, b, valid):
    """The copies of the page at pool row b (block id * H + KV head) into one buffer (codes ks,
    vs; scale pieces s0..s3), none unless valid (a commit group either way)."""
    tok = gl.arange(0, 64, layout=gl.SliceLayout(1, WL))
    wd = gl.arange(0, 32, layout=gl.SliceLayout(0, WL))
    off = (b * 64 + tok[:, None]) * 32 + wd[None, :]
    lim = valid.to(gl.int32) * 1024
    cp.async_copy_global_to_shared(ks, KC + off, mask=wd[None, :] < lim)
    cp.async_copy_global_to_shared(vs, VC + off, mask=wd[None, :] < lim)
    o = gl.arange(0, 128, layout=SL)
    cp.async_copy_global_to_shared(s0, KS + b * 128 + o, mask=o < lim)
    cp.async_copy_global_to_shared(s1, KZ + b * 128 + o, mask=o < lim)
    tv = gl.arange(0, 64, layout=gl.SliceLayout(1, VL))
    gv = gl.arange(0, 2, layout=gl.SliceLayout(0, VL))
    ov = b * 128 + tv[:, None] * 2 + gv[None, :]
    cp.async_copy_global_to_shared(s2, VS + ov, mask=gv[None, :] < lim)
    cp.async_copy_global_to_shared(s3, VZ + ov, mask=gv[None, :] < lim)
    cp.commit_group()


@gluon.jit
def _buffers(NBUF: gl.constexpr):
    """NBUF shared-memory buffers of a page: K and V codes, K's scales and zeros, V's scales and zeros."""
    return (gl.allocate_shared_memory(gl.int16, [NBUF, 64, 32], SH), gl.allocate_shared_memory(gl.int16, [NBUF, 64, 32], SH),
            gl.allocate_shared_memory(gl.int16, [NBUF, 128], SH1), gl.allocate_shared_memory(gl.int16, [NBUF, 128], SH1),
            gl.allocate_shared_memory(gl.int16, [NBUF, 64, 2], SH), gl.allocate_shared_memory(gl.int16, [NBUF, 64, 2], SH))


@gluon.jit
def _issue_page(KC, VC, KS, KZ, VS, VZ, kb, vb, s0, s1, s2, s3, u, b, valid):
    """_issue into buffer u of the six."""
    _issue(KC, VC, KS, KZ, VS, VZ, kb.index(u), vb.index(u), s0.index(u), s1.index(u), s2.index(u), s3.index(u), b, valid)


@gluon.jit
def _nibbles(w):
    """int16 code words -> their four nibble tiles as fp16 1024 + c (even) and 1024 + 16c (odd)."""
    return gl.inline_asm_elementwise(NIB, "=r,=r,=r,=r,r", [w], dtype=(gl.float16,) * 4, is_pure=True, pack=2)


@gluon.jit
def _k_operand(w):
    """K's code words [64 tokens, 32] (layout WL) -> the K dot's second operand [128 (k order), 64 tokens]."""
    c0, c1, c2, c3 = _nibbles(w)
    kt = gl.reshape(gl.join(gl.join(c0, c1), gl.join(c2, c3)), [64, 4, 4, 2, 2, 2])  # token, t, i, p, ra, rb (nibble 2 rb + ra)
    return gl.convert_layout(gl.reshape(gl.permute(kt, [2, 4, 5, 1, 3, 0]), [128, 64]), DB, assert_trivial=True)


@gluon.jit
def _softmax_step(s, m, l):
    """Online base-2 softmax over a page's scores s [16, 64]: the new max and sum, the
    probabilities and the old state's factor."""
    m_new = gl.maximum(m, gl.max(s, 1))
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new[:, None])
    return m_new, l * alpha + gl.sum(p, 1), p, alpha


@gluon.jit(do_not_specialize=["j_first", "pages"])
def walk(KC, VC, KS, KZ, VS, VZ, TABLE, Q, OUT, ML, j_first, pages, H: gl.constexpr, NBUF: gl.constexpr,
         G: gl.constexpr = 4, QVEC: gl.constexpr = False, IDS_AHEAD: gl.constexpr = False):
    """Program (KV head h, split sp) walks logical blocks j_first + sp * pages onward, `pages` of
    them, of row 0's table; writes its normalized [16, 128] output (channel order) and its
    per-row (m, l) at program h * splits + sp. Options for where the fixed time goes: G stores
    only the first G rows (the real query heads; G=16, every row of the padded dot, cost 9 us at
    every size in notes v24's first table); QVEC loads the query 16 bytes a lane and
    moves it into the dot's layout; IDS_AHEAD loads each page's block id a step before its
    copies."""
    h = gl.program_id(0)
    sp = gl.program_id(1)
    j0 = j_first + sp * pages
    kbuf, vbuf, sb0, sb1, sb2, sb3 = _buffers(NBUF)
    for i in gl.static_range(NBUF - 1):
        b = gl.load(TABLE + j0 + gl.minimum(i, pages - 1)).to(gl.int64) * H + h
        _issue_page(KC, VC, KS, KZ, VS, VZ, kbuf, vbuf, sb0, sb1, sb2, sb3, i, b, i < pages)
    b = gl.load(TABLE + j0 + gl.minimum(NBUF - 1, pages - 1)).to(gl.int64) * H + h  # (IDS_AHEAD) the next copies' page
    if QVEC:
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0])
        rq = gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
        kq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
        q = gl.convert_layout(gl.load(Q + (h * 16 + rq[:, None]) * 128 + kq[None, :]), DA)
    else:
        rq = gl.arange(0, 16, layout=gl.SliceLayout(1, DA))
        kq = gl.arange(0, 128, layout=gl.SliceLayout(0, DA))
        q = gl.load(Q + (h * 16 + rq[:, None]) * 128 + kq[None, :])
    m = gl.full([16], -1.0e30, gl.float32, gl.SliceLayout(1, MMA))
    l = gl.zeros([16], gl.float32, gl.SliceLayout(1, MMA))
    o0 = gl.zeros([16, 32], gl.float32, MMA)
    o1 = o0
    o2 = o0
    o3 = o0
    for i in range(pages):
        gl.thread_barrier()  # every lane has read the buffer the next copies overwrite
        nxt = i + NBUF - 1
        if not IDS_AHEAD:
            b = gl.load(TABLE + j0 + gl.minimum(nxt, pages - 1)).to(gl.int64) * H + h
        _issue_page(KC, VC, KS, KZ, VS, VZ, kbuf, vbuf, sb0, sb1, sb2, sb3, nxt % NBUF, b, nxt < pages)
        if IDS_AHEAD:
            b = gl.load(TABLE + j0 + gl.minimum(nxt + 1, pages - 1)).to(gl.int64) * H + h
        cp.wait_group(NBUF - 1)
        gl.thread_barrier()
        s = mma_v2(q, _k_operand(kbuf.index(i % NBUF).load(WL)), gl.zeros([16, 64], gl.float32, MMA))
        m, l, p, alpha = _softmax_step(s, m, l)
        pa = gl.convert_layout(p.to(gl.float16), DA, assert_trivial=True)
        vw = vbuf.index(i % NBUF).load(DB)  # [64 tokens, 32 words], token pairs in a register (ldmatrix .trans)
        v0, v1, v2, v3 = _nibbles(vw)
        a = alpha[:, None]
        o0 = mma_v2(pa, v0, o0 * a)
        o1 = mma_v2(pa, v1, o1 * a)
        o2 = mma_v2(pa, v2, o2 * a)
        o3 = mma_v2(pa, v3, o3 * a)
    cp.wait_group(0)
    ro = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    eo = gl.arange(0, 32, layout=gl.SliceLayout(0, MMA))
    prog = h * gl.num_programs(1) + sp
    base = OUT + (prog * 16 + ro[:, None]) * 128 + 4 * eo[None, :]
    li = 1.0 / l[:, None]
    real = ro[:, None] < G
    gl.store(base, o0 * li, mask=real)
    gl.store(base + 1, o1 * li, mask=real)
    gl.store(base + 2, o2 * li, mask=real)
    gl.store(base + 3, o3 * li, mask=real)
    gl.store(ML + (prog * 16 + ro) * 2, m)
    gl.store(ML + (prog * 16 + ro) * 2 + 1, l)


@gluon.jit
def logical_k(x):
    """[128] in channel order -> the K dot's k order (k = 32 i + 16 ra + 8 rb + 2 t + p for
    channel 32 t + 8 i + 4 p + 2 rb + ra), by register renaming only."""
    return gl.reshape(gl.permute(gl.reshape(x, [4, 4, 2, 2, 2]), [1, 4, 3, 0, 2]), [128])


@gluon.jit
def _scales(x, F16: gl.constexpr):
    """int16 words of scales or zeros -> fp16 values (F16), or bf16 values widened to fp32."""
    if F16:
        y = x.to(gl.float16, bitcast=True)
    else:
        y = x.to(gl.bfloat16, bitcast=True).to(gl.float32)
    return y


@gluon.jit(do_not_specialize=["j_first", "pages"])
def attend(KC, VC, KS, KZ, VS, VZ, TABLE, Q, OUT, ML, j_first, pages, H: gl.constexpr, NBUF: gl.constexpr, G: gl.constexpr = 4,
           F16: gl.constexpr = False):
    """The walk with the scales: attention of 16 query rows (the first G real) over the pages
    with their bf16 scales and zero points, as the decode kernel's side loop computes it:
    - K: the query (fp16, the K dot's k order, /16 where the codes are 1024 + 16c) times K's
      scales in fp16 as the first operand; q . z - 1024 * the operand's sums as the scores'
      starting value (two small dots, exact sums of fp16 products);
    - V: the probabilities times V's per-token scales in fp16, one operand a group (and /16
      for odd nibbles); sum_t p zv (a dot of fp16 p and zeros) and 1024 * the operand's sums
      taken out at the end.
    F16: the scales and zeros are fp16 (not bf16) and are applied in fp16 products (HMUL2)
    without widening to fp32: the probabilities are rounded to fp16 before their product with
    V's scales (a second rounding). Writes the normalized [16, 128] output in channel order and
    (m, l) as walk does."""
    h = gl.program_id(0)
    sp = gl.program_id(1)
    j0 = j_first + sp * pages
    kbuf, vbuf, ksb, kzb, vsb, vzb = _buffers(NBUF)
    for i in gl.static_range(NBUF - 1):
        b = gl.load(TABLE + j0 + gl.minimum(i, pages - 1)).to(gl.int64) * H + h
        _issue_page(KC, VC, KS, KZ, VS, VZ, kbuf, vbuf, ksb, kzb, vsb, vzb, i, b, i < pages)
    rq = gl.arange(0, 16, layout=gl.SliceLayout(1, DA))
    kq = gl.arange(0, 128, layout=gl.SliceLayout(0, DA))
    q = gl.load(Q + (h * 16 + rq[:, None]) * 128 + kq[None, :])
    q = q * gl.where((kq // 16) % 2 == 1, 0.0625, 1.0).to(gl.float16)[None, :]  # against 1024 + 16c
    kz = gl.arange(0, 128, layout=gl.SliceLayout(1, DB))
    fz = gl.where((kz // 16) % 2 == 1, 16.0, 1.0)  # z * 16 against q / 16
    bias = gl.full([128, 8], -1024.0, gl.float16, DB)
    ones = gl.full([64, 8], 1.0, gl.float16, DB)
    zb8 = gl.zeros([128, 8], gl.float16, DB)
    zt8 = gl.zeros([64, 8], gl.float16, DB)
    m = gl.full([16], -1.0e30, gl.float32, gl.SliceLayout(1, MMA))
    l = gl.zeros([16], gl.float32, gl.SliceLayout(1, MMA))
    w0 = gl.zeros([16, 8], gl.float32, MMA)  # sums of the V operands (group 0, 1)
    w1 = w0
    z0 = w0  # sum_t p zv (group 0, 1)
    z1 = w0
    o00 = gl.zeros([16, 16], gl.float32, MMA)  # o{r}{g}: nibble r of V's words 16 g .. 16 g + 15
    o10 = o00
    o20 = o00
    o30 = o00
    o01 = o00
    o11 = o00
    o21 = o00
    o31 = o00
    b = gl.load(TABLE + j0 + gl.minimum(NBUF - 1, pages - 1)).to(gl.int64) * H + h
    for i in range(pages):
        gl.thread_barrier()  # every lane has read the buffer the next copies overwrite
        nxt = i + NBUF - 1
        _issue_page(KC, VC, KS, KZ, VS, VZ, kbuf, vbuf, ksb, kzb, vsb, vzb, nxt % NBUF, b, nxt < pages)
        b = gl.load(TABLE + j0 + gl.minimum(nxt + 1, pages - 1)).to(gl.int64) * H + h
        cp.wait_group(NBUF - 1)
        gl.thread_barrier()
        u = i % NBUF
        kt = _k_operand(kbuf.index(u).load(WL))
        sk = gl.convert_layout(logical_k(_scales(ksb.index(u).load(XK), F16)), gl.SliceLayout(0, DA), assert_trivial=True)
        zk = gl.convert_layout(logical_k(_scales(kzb.index(u).load(XK), F16)), gl.SliceLayout(1, DB), assert_trivial=True)
        a = q * sk.to(gl.float16)[None, :]
        corr = mma_v2(q, (zk * fz.to(zk.dtype)).to(gl.float16)[:, None] + zb8, mma_v2(a, bias, gl.zeros([16, 8], gl.float32, MMA)))
        corr = gl.join(corr, corr)
        corr = gl.join(corr, corr)
        corr = gl.join(corr, corr)
        corr = gl.convert_layout(gl.reshape(gl.permute(corr, [0, 4, 3, 2, 1]), [16, 64]), MMA, assert_trivial=True)
        s = mma_v2(a, kt, corr)
        m, l, p, alpha = _softmax_step(s, m, l)
        sv0, sv1 = gl.split(_scales(vsb.index(u).load(SV2), F16))
        zv0, zv1 = gl.split(_scales(vzb.index(u).load(SV2), F16))
        sv0 = gl.convert_layout(sv0, gl.SliceLayout(0, MMA), assert_trivial=True)
        sv1 = gl.convert_layout(sv1, gl.SliceLayout(0, MMA), assert_trivial=True)
        zv0 = gl.convert_layout(zv0, gl.SliceLayout(1, DB), assert_trivial=True)
        zv1 = gl.convert_layout(zv1, gl.SliceLayout(1, DB), assert_trivial=True)
        if F16:
            ph = p.to(gl.float16)
            pe0 = gl.convert_layout(ph * sv0[None, :], DA, assert_trivial=True)
            pe1 = gl.convert_layout(ph * sv1[None, :], DA, assert_trivial=True)
        else:
            pe0 = gl.convert_layout((p * sv0[None, :]).to(gl.float16), DA, assert_trivial=True)
            pe1 = gl.convert_layout((p * sv1[None, :]).to(gl.float16), DA, assert_trivial=True)
        po0 = pe0 * 0.0625
        po1 = pe1 * 0.0625
        p16 = gl.convert_layout(p.to(gl.float16), DA, assert_trivial=True)
        al = alpha[:, None]
        w0 = mma_v2(pe0, ones, w0 * al)
        w1 = mma_v2(pe1, ones, w1 * al)
        z0 = mma_v2(p16, zv0.to(gl.float16)[:, None] + zt8, z0 * al)
        z1 = mma_v2(p16, zv1.to(gl.float16)[:, None] + zt8, z1 * al)
        v00, v10, v20, v30 = _nibbles(vbuf.index(u).slice(0, 16, dim=1).load(DB))
        v01, v11, v21, v31 = _nibbles(vbuf.index(u).slice(16, 16, dim=1).load(DB))
        o00 = mma_v2(pe0, v00, o00 * al)
        o10 = mma_v2(po0, v10, o10 * al)
        o20 = mma_v2(pe0, v20, o20 * al)
        o30 = mma_v2(po0, v30, o30 * al)
        o01 = mma_v2(pe1, v01, o01 * al)
        o11 = mma_v2(po1, v11, o11 * al)
        o21 = mma_v2(pe1, v21, o21 * al)
        o31 = mma_v2(po1, v31, o31 * al)
    cp.wait_group(0)
    ro = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    eo = gl.arange(0, 16, layout=gl.SliceLayout(0, MMA))
    prog = h * gl.num_programs(1) + sp
    li = 1.0 / l
    e0 = gl.max(z0, 1) * li  # (every column of a [16, 8] sum is the same)
    e1 = gl.max(z1, 1) * li
    b0 = gl.max(w0, 1) * li
    b1 = gl.max(w1, 1) * li
    li = li[:, None]
    real = ro[:, None] < G
    base = OUT + (prog * 16 + ro[:, None]) * 128 + 4 * eo[None, :]
    gl.store(base, o00 * li - 1024.0 * b0[:, None] + e0[:, None], mask=real)
    gl.store(base + 1, o10 * li - 64.0 * b0[:, None] + e0[:, None], mask=real)
    gl.store(base + 2, o20 * li - 1024.0 * b0[:, None] + e0[:, None], mask=real)
    gl.store(base + 3, o30 * li - 64.0 * b0[:, None] + e0[:, None], mask=real)
    gl.store(base + 64, o01 * li - 1024.0 * b1[:, None] + e1[:, None], mask=real)
    gl.store(base + 65, o11 * li - 64.0 * b1[:, None] + e1[:, None], mask=real)
    gl.store(base + 66, o21 * li - 1024.0 * b1[:, None] + e1[:, None], mask=real)
    gl.store(base + 67, o31 * li - 64.0 * b1[:, None] + e1[:, None], mask=real)
    gl.store(ML + (prog * 16 + ro) * 2, m)
    gl.store(ML + (prog * 16 + ro) * 2 + 1, l)


def k_order():
    """Physical channel of each logical k of the K dot (the nibble-pair layout above)."""
    k = torch.arange(128)  # k = 32 i + 16 ra + 8 rb + 2 t + p: word 8t + 2i + p of the token, nibble 2 rb + ra
    i, ra, rb, t, p = k // 32, (k // 16) % 2, (k // 8) % 2, (k // 2) % 4, k % 2
    return 32 * t + 8 * i + 4 * p + 2 * rb + ra


def biased(codes_u8):
    """uint8 packed int4 [..., 64] -> fp32 [..., 128]: 1024 + c for even channels, 1024 + 16c for odd ones."""
    lo = (codes_u8 & 15).float() + 1024
    hi = (codes_u8 >> 4).float() * 16 + 1024
    return torch.stack([lo, hi], -1).flatten(-2)


def emulate(view, q, h, j0, pages):
    """fp64 torch of one program's (KV head h, pages j0..j0+pages-1) normalized output [16, 128] (channel order) and (m, l)."""
    ids = view.block_table[0, j0:j0 + pages].long()
    kc = biased(view.pages.k_codes[ids, h]).double().reshape(-1, 128)  # [tokens, channels]
    vc = biased(view.pages.v_codes[ids, h]).double().reshape(-1, 128)
    qk = torch.zeros(16, 128, dtype=torch.float64, device=q.device)
    qk[:, k_order().to(q.device)] = q[h].double()
    s = qk @ kc.T
    m = s.max(1).values
    p = torch.exp2(s - m[:, None])
    return (p @ vc) / p.sum(1)[:, None], m, p.sum(1)


def reference(view, q_log, h, j0, pages):
    """fp64 attention of one program's rows (query in the K dot's k order, base-2 scores) over
    the dequantized pages j0..j0+pages-1 of KV head h: output [16, 128] in channel order, m, l."""
    ids = view.block_table[0, j0:j0 + pages].long()
    p_ = view.pages

    def unpack(codes):
        return torch.stack([codes & 15, codes >> 4], -1).flatten(-2).double()  # [..., tokens, 128]

    k = unpack(p_.k_codes[ids, h]) * p_.k_scale[ids, h].double()[:, None, :] + p_.k_zero[ids, h].double()[:, None, :]
    gs = 128 // p_.v_scale.shape[-1]
    sv = p_.v_scale[ids, h].double().repeat_interleave(gs, -1)
    zv = p_.v_zero[ids, h].double().repeat_interleave(gs, -1)
    v = unpack(p_.v_codes[ids, h]) * sv + zv
    q = torch.zeros(16, 128, dtype=torch.float64, device=q_log.device)
    q[:, k_order().to(q_log.device)] = q_log[h].double()
    s = q @ k.reshape(-1, 128).T
    m = s.max(1).values
    pr = torch.exp2(s - m[:, None])
    return (pr @ v.reshape(-1, 128)) / pr.sum(1)[:, None], m, pr.sum(1)


def compile_sass(fn, opts):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: "*i16" for n in ("KC", "VC", "KS", "KZ", "VS", "VZ")}
    sig.update(TABLE="*i32", Q="*fp16", OUT="*fp32", ML="*fp32", j_first="i32", pages="i32")
    defaults = {"G": 4, "QVEC": False, "IDS_AHEAD": False} if fn is walk else {"G": 4, "F16": False}
    src = GluonASTSource(fn, sig, {"H": 8, **defaults, **opts}, {(i,): [["tt.divisibility", 16]] for i in range(10)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp/gluon_walk.cubin")
    cubin.write_bytes(k.asm["cubin"])
    sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True, check=True).stdout
    print(" ".join(re.findall(r"(REG:\d+|SHARED:\d+|STACK:\d+)", usage)))
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        mm = re.search(r"BRA\s+(?:!?P\d,\s*)?(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if mm and mm.group(1) and int(mm.group(1), 16) < addr:
            loops.append([t for a, t in ins if int(mm.group(1), 16) <= a <= addr])
    body = max(loops, key=len) if loops else [t for _, t in ins]
    ops = Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body)
    print(f"loop body: {len(body)} instructions", ops.most_common(24))


def variants(nbufs, ab):
    """[(label, walk's compile-time options)]: each buffer count, then each --ab set
    ("KEY=VALUE,...") over the first buffer count."""
    known = {"walk": ("NBUF", "G", "QVEC", "IDS_AHEAD"), "attend": ("NBUF", "G", "F16")}
    out = [(f"{n} buffers", {"NBUF": n}) for n in nbufs]
    for text in ab:
        opts = {"NBUF": nbufs[0]}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            try:
                opts[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                sep = ""
            if not sep:
                raise SystemExit(f"--ab {text!r}: {item!r} is not KEY=VALUE (a Python literal)")
        kernel = "attend" if opts.pop("ATTEND", False) else "walk"
        bad = sorted(set(opts) - set(known[kernel]))
        if bad:
            raise SystemExit(f"--ab {text!r}: {kernel} has no option {', '.join(bad)}; it takes {', '.join(known[kernel])}")
        if kernel == "attend":
            opts["ATTEND"] = True
        out.append((text, opts))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 and count the loop (no GPU needed)")
    ap.add_argument("--nbuf", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--ab", nargs="*", default=[], help='option sets over the first buffer count, e.g. "G=4" "G=4,QVEC=True"')
    ap.add_argument("--contexts", default="65536,131072,262144,524288")
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds of every variant, in turn")
    ap.add_argument("--splits", type=int, default=0, help="splits a KV head (0: as many as fill 8 programs an SM)")
    a = ap.parse_args()
    sets = variants(a.nbuf, a.ab)
    if a.sass:
        for label, opts in sets:
            print(label, end=": ")
            compile_sass(attend if opts.get("ATTEND") else walk, {k: v for k, v in opts.items() if k != "ATTEND"})
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    dev = torch.device("cuda")
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    contexts = [int(x) for x in a.contexts.split(",")]
    for T in contexts:
        time_context(T, a.splits or (8 * sm) // 8, sets, a.rounds, check_all=T == contexts[0], dev=dev)


def time_context(T, S, sets, rounds, check_all, dev, H=8, D=128):
    """Check, then time, the walk at context T (S splits a KV head) with each option set, and
    the decode call on the same pages, `rounds` times in turn. check_all: also check a zero
    query and one page a program (the first context)."""
    from longctx.bench import _config, _copies, _time_graph, synthetic_view, view_bytes
    from longctx.ops.paged_attention import paged_attention
    cfg = _config("int4", 64)
    view0 = synthetic_view(1, T, H, D, cfg, dev)
    copies = _copies(view_bytes(view0))
    views = [view0] + [synthetic_view(1, T, H, D, cfg, dev, seed=c) for c in range(1, copies)]
    pages = (view0.block_table.shape[1] - view0.n_sink) // S
    q16 = (torch.randn(H, 16, D, device=dev) * 0.02).half()
    q16[:, 4:] = 0  # 4 query heads a KV head (Llama-3-8B), padded to the dot's 16 rows
    out = torch.empty(H * S * 16, D, device=dev)
    ml = torch.empty(H * S * 16, 2, device=dev)
    qd = torch.randn(1, 4 * H, 1, D, device=dev, dtype=torch.bfloat16)

    half = {}  # fp16 copies of the scales, made once (F16)
    if any(o.get("F16") for _, o in sets):
        for v in views:
            for x in (v.pages.k_scale, v.pages.k_zero, v.pages.v_scale, v.pages.v_zero):
                half[id(x)] = x.half().view(torch.int16)
    qa = torch.randn(H, 16, D, device=dev).half()  # attend: base-2 scores of a few units
    qa[:, 4:] = 0

    def launch(v, q, n, opts):
        p = v.pages
        w = [x.view(torch.int16) for x in (p.k_codes, p.v_codes, p.k_scale, p.k_zero, p.v_scale, p.v_zero)]
        if opts.get("ATTEND"):
            if opts.get("F16"):  # the same bytes, as fp16 (the bench's bf16 values rounded)
                w = w[:2] + [half[id(x)] for x in (p.k_scale, p.k_zero, p.v_scale, p.v_zero)]
            attend[(H, S)](*w, v.block_table, q, out, ml, v.n_sink, n, H=H, num_warps=1, **{k: x for k, x in opts.items() if k != "ATTEND"})
        else:
            walk[(H, S)](*w, v.block_table, q, out, ml, v.n_sink, n, H=H, num_warps=1, **opts)

    for k, (label, opts) in enumerate(sets):
        att = opts.get("ATTEND", False)
        for qz, pg in ((True, 1), (False, 1), (False, pages)) if check_all and (k == 0 or att) else ((False, pages),):
            qq = torch.zeros_like(q16) if qz else qa if att else q16
            launch(view0, qq, pg, opts)
            torch.cuda.synchronize()
            eo, em = [], []
            for h, sp in ((0, 0), (H - 1, S - 1), (3, S // 2)):
                ref, mr, _ = (reference if att else emulate)(view0, qq, h, view0.n_sink + sp * pg, pg)
                prog = h * S + sp
                got = out[prog * 16:prog * 16 + 4].double()
                eo.append(((got - ref[:4]).abs().max() / ref[:4].abs().max()).item())
                em.append(((ml[prog * 16:prog * 16 + 4, 0].double() - mr[:4]).abs() / mr[:4].abs().clamp_min(1)).max().item())
            print(f"  check {label} ({'q = 0' if qz else 'random q'}, {pg} pages a program): o {max(eo):.2e}, m {max(em):.2e}"
                  + ("" if max(eo + em) < 2e-3 else f" FAILED; program 0 row 0 o[:6] {out[0, :6].tolist()} against "
                     f"{(reference if att else emulate)(view0, qq, 0, view0.n_sink, pg)[0][0, :6].tolist()}"))
    for _ in range(rounds):
        for label, opts in sets:
            qt = qa if opts.get("ATTEND") else q16
            t = _time_graph(lambda i, opts=opts, qt=qt: launch(views[i], qt, pages, opts), copies, 20)
            print(f"{T}: gluon walk, {label}, {H} x {S} programs of {pages} pages: {t * 1000:.2f} us "
                  f"({pages * H * S * 9216 / t / 1e9:.2f} TB/s of sealed pages)")
        t = _time_graph(lambda i: paged_attention(qd, views[i], backend="triton", return_lse=False), copies, 20)
        print(f"{T}: decode call (triton kernel + merge launch), same pages: {t * 1000:.2f} us")


if __name__ == "__main__":
    main()
