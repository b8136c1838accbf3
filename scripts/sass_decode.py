"""Compile the decode kernel for the H200 (sm_90, or --arch) on a machine without a GPU and count
what its loops execute: registers, shared memory, and per loop the SASS instructions by opcode.
It exits with an error where the kernel's shared memory is over the target's limit a block.

Triton compiles for a named target without a device; ptxas and cuobjdump ship in the triton
wheel. The counts are per warp and loop step; they say where the instructions go (code
conversion, shared-memory round trips, softmax) before a GPU call measures the time.
Pointer arguments and the integers Triton specializes are marked 16-divisible, as real
launches on contiguous pools are; the compiler may differ in minor ways from the GPU's triton.

Usage (repo root):
  python3 scripts/sass_decode.py                          # int4, 64-token pages, TUNE's settings
  python3 scripts/sass_decode.py --bits 8 --pages 1 --warps 8
  python3 scripts/sass_decode.py --keep /tmp/sass          # also write .ttgir/.ptx/.sass there
  python3 scripts/sass_decode.py --live                    # each loop's peak of live registers
  python3 scripts/sass_decode.py --prefill 64 --stages 2   # the prefill kernel, 64 query rows a program
  python3 scripts/sass_decode.py --merge-splits 131 --merge-chunk 64 --warps 4   # the merge launch's kernel
  python3 scripts/sass_decode.py --wp 1 --g-pad 4 --stages 2 --merge launch --k16 1 --svt 1 --group-size 64
      # TUNE's side-by-side loop at the bench's shape (run it with the GPU's triton, 3.6, to match its compiler)
"""

import argparse
import inspect
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from longctx.ops.backend import TRITON_OPTIONS  # noqa: E402
from longctx.ops.paged_attention import prefill as PF  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402
from arch_compile import SHARED_LIMIT  # noqa: E402  (scripts/, this script's folder)

POINTERS = {"BOUNDS": "*i32", "TABLE": "*i32", "START": "*i32", "O": "*fp32", "OR": "*fp32", "LSE": "*fp32", "LOUT": "*fp32", "COUNT": "*i32"}


def compile_decode(a):
    fn = PF._prefill_kernel if a.prefill else K._decode_kernel
    names = list(inspect.signature(fn.fn).parameters)
    words = a.words and a.bits in (4, 8)
    code = "*i16" if words else "*u8"
    ptrs = dict(POINTERS, KC=code, VC=code, **{n: f"*{a.scales}" for n in ("KS", "KZ", "VS", "VZ")})
    half = a.dtype != "fp32"  # (the launcher's dots take the queries' dtype; fp32 takes no 16-bit dequantization)
    dot = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[a.dtype]
    G = a.q_heads // a.kv_heads
    gm = triton.next_power_of_2(G)
    const = dict(H=a.kv_heads, G=G, G_PAD=max(a.g_pad, gm), D=a.head_dim, P=a.block_size, K_BITS=a.bits, V_BITS=a.v_bits or a.bits, GS=a.group_size,
                 ROTATE=a.rotate, HAS_START=False, DOT=dot, PREC="tf32" if half else "ieee", K16=a.k16 if half else 0, V16=a.v16 if half else 0, KDT=tl.bfloat16 if a.bits <= 4 else tl.float16, PAGES=a.pages,
                 WORDS=a.words, ASM=a.asm, MERGE=a.merge == "kernel", GM=gm, SB=max(1, 4096 // (gm * a.head_dim)),
                 PK=K._per(a.bits, a.words), PV=K._per(a.v_bits or a.bits, a.words), WP=a.wp, TD=a.tile if a.tile < a.block_size and not a.prefill else 0, SVT=bool(a.svt), ZDOT=bool(a.svt and a.zdot), DENSE=min(a.dense, a.block_size) if a.wp else a.tile if a.tile < a.block_size and not a.prefill else 0,
                 # (the 2-D loop in tiles: its sinks and tail take the same tile)
                 SKIP=bool(a.skip), STAMPS=None, TINY_CODES=bool(a.tiny and a.wp), PDL=bool(a.pdl), TREE=a.tree if a.merge == "kernel" else 0, MASK=bool(a.mask) if a.mask is not None else not (a.wp == 1 and a.bits <= K.TUNE["side_unmasked"]))
    const.update(GRID=0, S_PAD=0, SC=0, BD=0, TAIL_DEV=False, BLOCKS_DEV=False, R=a.rows, ROT_Q=a.rotate and bool(a.rot_query),
                 ROT_O=a.rotate and bool(a.rot_out), INV_SQRT_D=K.hadamard_scale(a.head_dim) if a.rotate else 1.0, PTX=True)  # (host lengths, as eager calls pass them)
    if not a.bounds:
        const["BOUNDS"] = None
    if a.merge == "grid":  # merge programs after the splits in the same grid (TUNE merge "grid")
        const.update(GRID=G * (a.head_dim // a.merge_cols if a.merge_cols else 1), S_PAD=max(2, triton.next_power_of_2(a.grid_splits)),
                     SC=a.merge_chunk, BD=a.merge_cols)
    if a.merge_splits:  # the merge launch's kernel instead (_merge_kernel)
        fn = K._merge_kernel
        names = list(inspect.signature(fn.fn).parameters)
        const = {"PDL": bool(a.pdl), "HQ": a.q_heads, "D": a.head_dim, "S_PAD": max(2, triton.next_power_of_2(a.merge_splits)), "SC": a.merge_chunk,
                 "BD": a.merge_cols}
        ptrs = dict(POINTERS, OUT="*bf16")
    elif a.prefill:  # the prefill kernel: a.prefill rows (query tokens x G heads) a program
        bt = max(1, a.prefill // G)
        const.update(BT=bt, M=max(16, triton.next_power_of_2(bt * G)), TP=a.tile if a.tile < a.block_size else 0)
        const = {k: v for k, v in const.items() if k in names}
    const = {k: v for k, v in const.items() if k in names}  # (a kernel of another commit may lack newer ones)
    nospec = {names[i] if isinstance(i, int) else i for i in (getattr(fn, "do_not_specialize", None) or ())}
    sig = {n: "constexpr" if n in const else ptrs.get(n, f"*{a.dtype}") if n.isupper() and n not in ("C", "S") else "fp32" if n == "scale" else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (sig[n] == "i32" and n not in nospec)}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", a.arch, 32), options=dict(num_warps=a.warps, num_stages=a.stages, **TRITON_OPTIONS,
                                                                                **({"maxnreg": a.maxnreg} if a.maxnreg else {})))


def loops(sass: str):
    """(start, end, [opcodes]) of every backward branch's body, largest first."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:!?P\d,\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            ops = [t.split()[1 if t.startswith("@") else 0].split(".")[0] for x, t in ins if lo <= x <= addr]
            found.append((lo, addr, ops))
    return sorted(found, key=lambda f: -len(f[2]))


def live_registers(nvdisasm: Path, cubin: Path):
    """[(address, live general registers)] of every instruction (nvdisasm's life ranges), or
    None with nvdisasm's complaint (it refuses kernels that use all 255 registers)."""
    run = subprocess.run([nvdisasm, "--life-range-mode", "count", cubin], capture_output=True, text=True, check=False)
    rows = [(int(m.group(1), 16), int(m.group(2))) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/[^\n]*?\|\s*(\d+)\s*\|", run.stdout)]
    return rows or None, run.stderr.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, default=4, choices=(16, 8, 4, 2))
    ap.add_argument("--v-bits", type=int, default=0, choices=(0, 16, 8, 4, 2), help="V's bits where they differ from K's (--bits)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (80: A100, 86: RTX 3090, 89: RTX 4090, 90: H100/H200)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--rotate", action="store_true")
    ap.add_argument("--rot-query", type=int, default=int(K.TUNE["rot_query"]), help="with --rotate: the program rotates its queries (TUNE rot_query)")
    ap.add_argument("--rot-out", type=int, default=int(K.TUNE["rot_out"]), help="with --rotate: the program rotates its share back (TUNE rot_out)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="dtype of the queries, the outputs and 16-bit pages, sinks and tail (fp32: dots in fp32, no 16-bit dequantization)")
    ap.add_argument("--scales", default="bf16", choices=("bf16", "fp16", "fp32"), help="dtype of the scales and zero points")
    ap.add_argument("--g-pad", type=int, default=16, help="pad the query heads of a KV head to at least this many rows")
    ap.add_argument("--warps", type=int, default=K.TUNE["num_warps"])
    ap.add_argument("--stages", type=int, default=K.TUNE["num_stages"])
    ap.add_argument("--maxnreg", type=int, default=K.TUNE["maxnreg"], help="cap registers per thread (0: none; ptxas spills past it)")
    ap.add_argument("--pages", type=int, default=K.TUNE["pages"])
    ap.add_argument("--wp", type=int, default=0, help="sealed pages side by side a step, one a warp (sets --warps; 0: the 2-D loop)")
    ap.add_argument("--k16", type=int, default=K.TUNE["k16"])
    ap.add_argument("--svt", type=int, default=0, help="side by side: values transposed, their scales folded into the probabilities")
    ap.add_argument("--zdot", type=int, default=0, help="with --svt: V's zero-point term as a small dot (TUNE side_zdot)")
    ap.add_argument("--dense", type=int, default=K.TUNE["side_dense"], help="side by side: sink and tail tokens a step")
    ap.add_argument("--v16", type=int, default=int(K.TUNE["v16"]), help="0: fp32 V, 1: fp16, 2: bf16 where exact")
    ap.add_argument("--words", type=int, default=int(K.TUNE["words"]))
    ap.add_argument("--asm", type=int, default=int(K.TUNE["asm"]), help="0: no inline PTX; int4 sub-tiles a PTX block (1, 2, 4)")
    ap.add_argument("--merge", default="kernel", choices=("kernel", "launch", "grid"),
                    help="kernel: with the in-kernel merge; grid: with merge programs in the grid (--grid-splits, --merge-cols, --merge-chunk)")
    ap.add_argument("--grid-splits", type=int, default=128, help="with --merge grid: the splits its merge programs are compiled for")
    ap.add_argument("--tree", type=int, default=K.TUNE["merge_tree"], help="with --merge kernel: splits a merge group (0: the last split merges all)")
    ap.add_argument("--merge-splits", type=int, default=0, help="compile the merge launch's kernel for this many splits instead")
    ap.add_argument("--merge-chunk", type=int, default=K.TUNE["merge_chunk"], help="with --merge-splits or --merge grid: splits read at a time (0: all)")
    ap.add_argument("--skip", type=int, default=0, help="side by side: programs without sinks or tail skip their loops (TUNE side_skip)")
    ap.add_argument("--mask", type=int, default=None, help="side by side: mask the scores (default: the launcher's rule for a "
                    "batch without padding, TUNE side_unmasked)")
    ap.add_argument("--tiny", type=int, default=int(K.TUNE["side_tiny"]), help="side by side: the codes as fp16 subnormals (TUNE side_tiny)")
    ap.add_argument("--rows", type=int, default=1, help="rows whose queries a program takes together (R: the shared launch of a prompt's beams, TUNE shared_rows // G)")
    ap.add_argument("--bounds", action="store_true", help="the splits' boundaries from a table (the kernel's BOUNDS, scripts/diag_balance.py)")
    ap.add_argument("--pdl", type=int, default=0, help="launched as a programmatic dependent (TUNE pdl)")
    ap.add_argument("--merge-cols", type=int, default=0, help="with --merge-splits or --merge grid: columns a program (0: all)")
    ap.add_argument("--prefill", type=int, default=0, help="compile the prefill kernel with this many rows a program instead")
    ap.add_argument("--tile", type=int, default=0, help="tokens of a page a step: the prefill kernel's (--prefill, TUNE prefill_tile) or the 2-D decode loop's (TUNE loop_tile); 0: the whole page")
    ap.add_argument("--keep", type=Path, help="write the kernel's .ttgir, .ptx and .sass into this folder")
    ap.add_argument("--live", action="store_true", help="also the peak of live registers in each loop and outside them "
                    "(nvdisasm's life ranges: where the kernel's register count comes from)")
    a = ap.parse_args()
    a.words = bool(a.words)
    a.warps = a.wp or a.warps
    kernel = compile_decode(a)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp/_sass_decode.cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"STACK:(\d+)", usage)
    total = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
    print(f"registers {regs.group(1) if regs else '?'}, stack {spill.group(1) if spill else '?'} bytes, shared memory {kernel.metadata.shared} bytes, {total} instructions")
    for lo, hi, ops in loops(sass):
        n = Counter(ops)
        top = ", ".join(f"{op} {k}" for op, k in n.most_common(14))
        print(f"loop {lo:#06x}-{hi:#06x}: {len(ops)} instructions per warp and step (spill loads/stores {n['LDL']}/{n['STL']}, "
              f"barriers {n['BAR']}): {top}")
    if a.live:
        rows, err = live_registers(tools / "nvdisasm", cubin)
        if rows is None:
            print(f"live registers: nvdisasm gave none ({err[:120]})")
        else:
            spans = [(lo, hi) for lo, hi, _ in loops(sass)]
            for lo, hi in spans:
                print(f"live registers, loop {lo:#06x}-{hi:#06x}: peak {max(c for x, c in rows if lo <= x <= hi)}")
            rest = [c for x, c in rows if not any(lo <= x <= hi for lo, hi in spans)]
            print(f"live registers outside the loops: peak {max(rest) if rest else 0}")
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (a.keep / f"decode.{ext}").write_text(kernel.asm[ext])
        (a.keep / "decode.cubin").write_bytes(kernel.asm["cubin"])
        (a.keep / "decode.sass").write_text(sass)
    limit = SHARED_LIMIT.get(a.arch)
    if limit is not None and kernel.metadata.shared > limit:
        sys.exit(f"shared memory {kernel.metadata.shared} bytes: over the {limit} a block may have on sm_{a.arch}")


if __name__ == "__main__":
    main()
