"""A Gluon page walk with the int4 side loop's arithmetic, to time the route of notes v24 on the H200.

One one-warp program per (KV head, split) walks its split of the bench's int4 pages (shared
pool, shuffled block table) in a loop that owns its copies: NBUF shared-memory buffers, each
page's copies (K and V codes, K's and V's scales and zeros: 9 KB at 64 tokens, head_dim 128)
issued NBUF - 1 pages ahead. Per page it does what the decode kernel's side loop does with the
codes: K's nibbles to fp16 (1024 + c, 1024 + 16c: LOP3s, no layout change) as the second
operand of [16 query rows, 128] x [128, 64 tokens], an online base-2 softmax, V's nibbles from
transposing shared-memory loads (ldmatrix .trans) as the second operand of the probabilities'
dot. It leaves out the scales' arithmetic (the copies are made), so it is a floor for such a
loop, not a kernel: its result is checked against an fp64 torch emulation of that arithmetic
(a zero query, then a random one), and timed as the bench times (CUDA-graph replays over enough
copies of the pool to defeat L2) against the decode call (Triton kernel and merge launch) on
the same pages. Gluon is triton 3.6's (the GPU image's); the CPU interpreter does not run it.

  PYTHONPATH=/tmp/t36 python3 scripts/gluon_walk.py --sass   # compile for sm_90 without a GPU, count the loop's SASS
  python3 scripts/gluon_walk.py --nbuf 2 3                   # on the GPU: check, then time against the decode call
"""
import argparse
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
# an int16 word's four nibbles of two words (one 32-bit register) -> fp16 pairs 1024 + c (even
# nibbles) and 1024 + 16c (odd ones)
NIB = gl.constexpr("{ .reg .b32 t; lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xea; lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xea; "
                   "shr.b32 t, $4, 8; lop3.b32 $2, t, 0x000F000F, 0x64006400, 0xea; lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xea; }")


@gluon.jit
def _issue(KC, VC, KS, KZ, VS, VZ, ks, vs, s0, s1, s2, s3, TABLE, j, valid, h, H: gl.constexpr):
    """The copies of logical block j's page of KV head h into one buffer (codes ks, vs; scale pieces s0..s3), none
    unless valid (a commit group either way)."""
    b = gl.load(TABLE + j).to(gl.int64) * H + h
    tok = gl.arange(0, 64, layout=gl.SliceLayout(1, WL))
    wd = gl.arange(0, 32, layout=gl.SliceLayout(0, WL))
    off = (b * 64 + tok[:, None]) * 32 + wd[None, :]
    lim = valid.to(gl.int32) * 1024
    cp.async_copy_global_to_shared(ks, KC + off, mask=wd[None, :] < lim)
    cp.async_copy_global_to_shared(vs, VC + off, mask=wd[None, :] < lim)
    o = gl.arange(0, 128, layout=SL)
    cp.async_copy_global_to_shared(s0, KS + b * 128 + o, mask=o < lim)
    cp.async_copy_global_to_shared(s1, KZ + b * 128 + o, mask=o < lim)
    cp.async_copy_global_to_shared(s2, VS + b * 128 + o, mask=o < lim)
    cp.async_copy_global_to_shared(s3, VZ + b * 128 + o, mask=o < lim)
    cp.commit_group()


@gluon.jit(do_not_specialize=["j_first", "pages"])
def walk(KC, VC, KS, KZ, VS, VZ, TABLE, Q, OUT, ML, j_first, pages, H: gl.constexpr, NBUF: gl.constexpr):
    """Program (KV head h, split sp) walks logical blocks j_first + sp * pages onward, `pages` of
    them, of row 0's table; writes its normalized [16, 128] output (channel order) and its
    per-row (m, l) at program h * splits + sp."""
    h = gl.program_id(0)
    sp = gl.program_id(1)
    j0 = j_first + sp * pages
    kbuf = gl.allocate_shared_memory(gl.int16, [NBUF, 64, 32], SH)
    vbuf = gl.allocate_shared_memory(gl.int16, [NBUF, 64, 32], SH)
    sb0 = gl.allocate_shared_memory(gl.int16, [NBUF, 128], SH1)
    sb1 = gl.allocate_shared_memory(gl.int16, [NBUF, 128], SH1)
    sb2 = gl.allocate_shared_memory(gl.int16, [NBUF, 128], SH1)
    sb3 = gl.allocate_shared_memory(gl.int16, [NBUF, 128], SH1)
    for i in gl.static_range(NBUF - 1):
        _issue(KC, VC, KS, KZ, VS, VZ, kbuf.index(i), vbuf.index(i), sb0.index(i), sb1.index(i), sb2.index(i), sb3.index(i), TABLE, j0 + gl.minimum(i, pages - 1), i < pages, h, H)
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
        _issue(KC, VC, KS, KZ, VS, VZ, kbuf.index(nxt % NBUF), vbuf.index(nxt % NBUF), sb0.index(nxt % NBUF),
               sb1.index(nxt % NBUF), sb2.index(nxt % NBUF), sb3.index(nxt % NBUF), TABLE,
               j0 + gl.minimum(nxt, pages - 1), nxt < pages, h, H)
        cp.wait_group(NBUF - 1)
        gl.thread_barrier()
        w = kbuf.index(i % NBUF).load(WL)
        c0, c1, c2, c3 = gl.inline_asm_elementwise(NIB, "=r,=r,=r,=r,r", [w], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
        kt = gl.reshape(gl.join(gl.join(c0, c1), gl.join(c2, c3)), [64, 4, 4, 2, 2, 2])  # token, t, i, p, ra, rb (nibble 2 rb + ra)
        kt = gl.convert_layout(gl.reshape(gl.permute(kt, [2, 4, 5, 1, 3, 0]), [128, 64]), DB, assert_trivial=True)
        s = mma_v2(q, kt, gl.zeros([16, 64], gl.float32, MMA))
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l = l * alpha + gl.sum(p, 1)
        m = m_new
        pa = gl.convert_layout(p.to(gl.float16), DA, assert_trivial=True)
        vw = vbuf.index(i % NBUF).load(DB)  # [64 tokens, 32 words], token pairs in a register (ldmatrix .trans)
        v0, v1, v2, v3 = gl.inline_asm_elementwise(NIB, "=r,=r,=r,=r,r", [vw], dtype=(gl.float16,) * 4, is_pure=True, pack=2)
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
    gl.store(base, o0 * li)
    gl.store(base + 1, o1 * li)
    gl.store(base + 2, o2 * li)
    gl.store(base + 3, o3 * li)
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


def compile_sass(nbuf):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: "*i16" for n in ("KC", "VC", "KS", "KZ", "VS", "VZ")}
    sig.update(TABLE="*i32", Q="*fp16", OUT="*fp32", ML="*fp32", j_first="i32", pages="i32")
    src = GluonASTSource(walk, sig, {"H": 8, "NBUF": nbuf}, {(i,): [["tt.divisibility", 16]] for i in range(10)})
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 and count the loop (no GPU needed)")
    ap.add_argument("--nbuf", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--contexts", default="65536,131072,262144,524288")
    ap.add_argument("--splits", type=int, default=0, help="splits a KV head (0: as many as fill 8 programs an SM)")
    a = ap.parse_args()
    if a.sass:
        for nb in a.nbuf:
            compile_sass(nb)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    dev = torch.device("cuda")
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    contexts = [int(x) for x in a.contexts.split(",")]
    for T in contexts:
        time_context(T, a.splits or (8 * sm) // 8, a.nbuf, check_all=T == contexts[0], dev=dev)


def time_context(T, S, nbufs, check_all, dev, H=8, D=128):
    """Check, then time, the walk at context T (S splits a KV head) with each buffer count in
    nbufs, and the decode call on the same pages. check_all: also check a zero query and one
    page a program (the first context)."""
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

    def launch(v, q, n, nbuf):
        p = v.pages
        w = [x.view(torch.int16) for x in (p.k_codes, p.v_codes, p.k_scale, p.k_zero, p.v_scale, p.v_zero)]
        walk[(H, S)](*w, v.block_table, q, out, ml, v.n_sink, n, H=H, NBUF=nbuf, num_warps=1)

    for nbuf in nbufs:
        for qz, pg in ((True, 1), (False, 1), (False, pages)) if check_all and nbuf == nbufs[0] else ((False, pages),):
            qq = torch.zeros_like(q16) if qz else q16
            launch(view0, qq, pg, nbuf)
            torch.cuda.synchronize()
            eo, em = [], []
            for h, sp in ((0, 0), (H - 1, S - 1), (3, S // 2)):
                ref, mr, _ = emulate(view0, qq, h, view0.n_sink + sp * pg, pg)
                prog = h * S + sp
                got = out[prog * 16:prog * 16 + 4].double()
                eo.append(((got - ref[:4]).abs().max() / ref[:4].abs().max()).item())
                em.append(((ml[prog * 16:prog * 16 + 4, 0].double() - mr[:4]).abs() / mr[:4].abs().clamp_min(1)).max().item())
            print(f"  check ({'q = 0' if qz else 'random q'}, {pg} pages a program): o {max(eo):.2e}, m {max(em):.2e}"
                  + ("" if max(eo + em) < 2e-3 else f" FAILED; program 0 row 0 o[:6] {out[0, :6].tolist()} against "
                     f"{emulate(view0, qq, 0, view0.n_sink, pg)[0][0, :6].tolist()}"))
        t = _time_graph(lambda i, nbuf=nbuf: launch(views[i], q16, pages, nbuf), copies, 20)
        print(f"{T}: gluon walk, {nbuf} buffers, {H} x {S} programs of {pages} pages: {t * 1000:.2f} us "
              f"({pages * H * S * 9216 / t / 1e9:.2f} TB/s of sealed pages), {t * 1000 / pages:.3f} us a page a program")
    t = _time_graph(lambda i: paged_attention(qd, views[i], backend="triton", return_lse=False), copies, 20)
    print(f"{T}: decode call (triton kernel + merge launch), same pages: {t * 1000:.2f} us")

if __name__ == "__main__":
    main()
