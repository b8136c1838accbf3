"""Compile the decode or prefill kernel for a GPU (sm_90, or --arch) on a machine without one and
count what its loops execute: registers, shared memory, and per loop the SASS instructions by
opcode. It exits with an error where the kernel's shared memory is over the target's limit a
block (tests/ops/test_gpu_compile.py runs it for the cards users have in CI).

Triton compiles for a named target without a device; ptxas and cuobjdump ship in the triton
wheel. Pointer arguments and the integers Triton specializes are marked 16-divisible, as real
launches on contiguous pools are; the compiler may differ in minor ways from the GPU's triton.

Usage (repo root):
  python3 tools/compile_kernels.py                          # int4, 64-token pages, side by side as the launcher takes them
  python3 tools/compile_kernels.py --bits 16 --side 0       # the 2-D loop over 16-bit pages
  python3 tools/compile_kernels.py --prefill 128 --stages 2 --warps 8   # the prefill kernel, 128 query rows a program
  python3 tools/compile_kernels.py --arch 89 --keep /tmp/sass          # an RTX 4090's build; .ttgir/.ptx/.sass kept
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
from longctx.quant import hadamard_scale  # noqa: E402

# shared memory a block may have, by compute capability (A100, RTX 3090, Jetson Orin, RTX 4090, H100/H200, B200, RTX 5090)
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
POINTERS = {"TABLE": "*i32", "START": "*i32", "O": "*fp32", "LSE": "*fp32", "LOUT": "*fp32", "COUNT": "*i32"}


def compile_kernel(a):
    """The decode kernel (or with --prefill the prefill kernel) compiled for sm_{a.arch} with
    the constexprs the launcher gives this shape (`kernel_consts`, and the side loop's rules)."""
    fn = PF._prefill_kernel if a.prefill else K.decode_kernel
    names = list(inspect.signature(fn.fn).parameters)
    v_bits = a.v_bits or a.bits
    code = {16: f"*{a.dtype}", 8: "*i16", 4: "*i16", 2: "*u8"}
    ptrs = dict(POINTERS, KC=code[a.bits], VC=code[v_bits], **{n: f"*{a.scales}" for n in ("KS", "KZ", "VS", "VZ")})
    half = a.dtype != "fp32"  # (the launcher's dots take the queries' dtype; fp32 takes no 16-bit dequantization)
    G = a.q_heads // a.kv_heads
    gm = triton.next_power_of_2(G)
    side = a.side if max(a.bits, v_bits) <= 8 and not a.prefill else 0
    scales16 = a.scales != "fp32"
    const = dict(H=a.kv_heads, G=G, G_PAD=max(4 if side else 16, triton.next_power_of_2(a.rows * G)), D=a.head_dim, P=a.block_size,
                 K_BITS=a.bits, V_BITS=v_bits, GS=a.group_size, ROTATE=a.rotate, HAS_START=False,
                 DOT={"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[a.dtype], PREC="tf32" if half else "ieee",
                 K16=int(half) if side else ((3 if scales16 else 2) if half else 0), V16=half,
                 KDT=tl.bfloat16 if a.scales == "bf16" and a.bits <= 4 else tl.float16, ASM=1, MERGE=a.merge == "kernel",
                 G_MERGE=gm, MERGE_STEP=max(1, 4096 // (gm * a.head_dim)), K_SUB=K.sub_tiles(a.bits), V_SUB=K.sub_tiles(v_bits),
                 SIDE_PAGES=side, V_TRANSPOSED=bool(side and half), ZERO_DOT=bool(side and half and v_bits <= 4), SKIP=bool(side),
                 MASK=not (side == 1 and max(a.bits, v_bits) <= 4), TINY_CODES=bool(side and half),
                 TREE=K.TUNE["merge_tree"] if a.merge == "kernel" else 0, R=a.rows, TAIL_DEV=False, BLOCKS_DEV=False,
                 INV_SQRT_D=hadamard_scale(a.head_dim) if a.rotate else 1.0, PTX=True,
                 TD=a.tile if a.tile < a.block_size and not a.prefill else 0, KG=a.k_span or a.block_size)
    const["DENSE"] = min(K.TUNE["side_dense"], a.block_size) if side else const["TD"]  # (the 2-D loop's tiles: its sinks and tail alike)
    if a.prefill:  # the prefill kernel: a.prefill rows (query tokens x G heads) a program; K in fp32, rounded once
        bt = max(1, a.prefill // G)
        const.update(BT=bt, M=max(16, triton.next_power_of_2(bt * G)), TP=a.tile if a.tile < a.block_size else 0,
                     K16=4 if half else 0, V16=False)
    const = {k: v for k, v in const.items() if k in names}
    nospec = {names[i] if isinstance(i, int) else i for i in (getattr(fn, "do_not_specialize", None) or ())}
    sig = {n: "constexpr" if n in const else ptrs.get(n, f"*{a.dtype}") if n.isupper() and n not in ("C", "S") else "fp32" if n == "scale" else "i32"
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or (sig[n] == "i32" and n not in nospec)}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    warps = a.warps or (side * (K.TUNE["shared_warps"] if a.rows > 1 else 1) if side else K.TUNE["num_warps"])
    return triton.compile(src, target=GPUTarget("cuda", a.arch, 32), options=dict(num_warps=warps, num_stages=a.stages, **TRITON_OPTIONS))


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
    ap.add_argument("--k-span", type=int, default=0, help="tokens a K scale row covers (0: the page; int2+rot: 16)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rotate", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="dtype of the queries, the outputs and 16-bit pages, sinks and tail")
    ap.add_argument("--scales", default="bf16", choices=("bf16", "fp16", "fp32"), help="dtype of the scales and zero points")
    ap.add_argument("--side", type=int, default=1, help="sealed pages side by side a step, one a warp, for pages of at most 8 bits (0: the 2-D loop)")
    ap.add_argument("--warps", type=int, default=0, help="warps a program (0: the launcher's for the loop)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--merge", default="launch", choices=("kernel", "launch"), help="kernel: with the in-kernel merge (eager calls)")
    ap.add_argument("--rows", type=int, default=1, help="rows whose queries a program takes together (the shared launch of a prompt's beams)")
    ap.add_argument("--prefill", type=int, default=0, help="compile the prefill kernel with this many rows a program instead")
    ap.add_argument("--tile", type=int, default=0, help="tokens of a page a step: the prefill kernel's or the 2-D decode loop's (0: the whole page)")
    ap.add_argument("--keep", type=Path, help="write the kernel's .ttgir, .ptx and .sass into this folder")
    ap.add_argument("--live", action="store_true", help="also the peak of live registers in each loop and outside them (nvdisasm's life ranges)")
    a = ap.parse_args()
    kernel = compile_kernel(a)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp/_compile_kernels.cubin")
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
