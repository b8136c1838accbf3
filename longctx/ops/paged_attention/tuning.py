"""The decode and prefill launchers' tuning table and the rules that fit a launch to the GPU:
split counts that fill one wave, programs that fit an SM, stages and page tiles that fit its
shared memory, and the probe that tells whether its tensor cores take subnormal fp16 codes
exactly. The measurements behind each choice are in docs/kernels.md.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ...errors import SharedMemoryError
from ..backend import TRITON_OPTIONS

# The live choices, measured on an H200 with triton 3.6 (docs/kernels.md has the figures):
TUNE = dict(
    # 16-bit pages and mixed formats with a 16-bit side: the 2-D loop, a page a step across num_warps warps
    num_warps=4, num_stages=3, short_stages=2, programs_per_sm=4, stages16=2, programs16=8,
    # sealed pages of at most 8 bits a side: `side` pages a step side by side, one a warp (0: the 2-D loop);
    # `side_short` where a program gets at most two pages (short contexts)
    side=1, side_short=2, side_rows=4, side_stages=2, side_programs=16, side_dense=32,
    # how splits merge: "auto" (in the decode launch when eager, a merge launch under graph capture), "kernel", "launch"
    merge="auto", merge_chunk=128, merge_cols=32, merge_tree=16, merge_tree_from=64,
    # rows holding their first blocks alike (a prompt's beams): a launch of their own from shared_from tokens
    shared_from=8192, shared_rows=8, shared_warps=1,
    # prefill: "auto" (in place under prefill_staged_from tokens, else staged), "kernel", "staged"
    prefill="auto", prefill_staged_from=128, prefill_rows=128, prefill_programs=1, prefill_warps=8, prefill_stages=2,
    # tokens of a page a loop step reads (0: the page where it fits the GPU's shared memory, else the largest tile that does)
    prefill_tile=0, loop_tile=0,
    # bytes of shared memory a launch may use where lower than the device's (0: the device's); tests set a consumer card's
    shared_limit=0,
)


KNOBS = frozenset(TUNE)


def check_knobs() -> None:
    """Refuses a TUNE that holds a key the launchers do not read (a typo, or a knob that no
    longer exists), which would otherwise change nothing and go unnoticed."""
    unknown = set(TUNE) - KNOBS
    if unknown:
        raise ValueError(f"TUNE holds unknown knobs {sorted(unknown)}; the knobs are {sorted(KNOBS)}")


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1), not compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_splits(batch: int, kv_heads: int, total_blocks: int, sm_count: int, programs_per_sm: int | None = None) -> int:
    """Splits of the KV length so that the (row, KV head, split) programs fill `programs_per_sm`
    per SM (what fits at once, `programs_fit`) in one whole wave, rounding down: a second,
    nearly empty wave doubled the time (batch 8 at 32k: 9 splits ran 0.279 ms, 8 by the same
    rule would leave 3 % of the slots idle). Short contexts and big batches get one program per
    (row, head), whose output needs no merge."""
    slots = (programs_per_sm or TUNE["programs_per_sm"]) * sm_count
    per_row_head = max(1, slots // max(1, batch * kv_heads))
    return max(1, min(per_row_head, total_blocks, 256))


def programs_fit(regs: int, shared: int, num_warps: int, props=None) -> int:
    """Programs of `num_warps` warps, `regs` registers a thread and `shared` bytes of shared
    memory that one SM holds at once (CUDA's occupancy rules: registers allocated per warp in
    units of 256, 1 KiB of shared memory reserved per block; sm_90's limits where `props`, a
    torch device-properties object, does not say)."""
    regs_sm = getattr(props, "regs_per_multiprocessor", 0) or 65536
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 233472
    threads_sm = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    per_warp = -(-max(1, regs) * 32 // 256) * 256
    by_regs = (regs_sm // per_warp) // num_warps
    by_smem = smem_sm // (shared + 1024)
    return max(1, min(by_regs, by_smem, threads_sm // (32 * num_warps), 32))


@functools.lru_cache(maxsize=8)
def _device_shared(device_index: int) -> int:
    """Shared memory a block may have on the device (what Triton checks before a launch)."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def shared_limit(device_index: int) -> int:
    """The device's shared memory a block, or TUNE["shared_limit"] where that is set and lower
    (a test of the fallback below on a card with more)."""
    cap = TUNE["shared_limit"]
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
        raise ValueError(f"TUNE['shared_limit'] must be a byte count >= 0 (0: the device's), got {cap!r}")
    own = _device_shared(device_index)
    return min(own, cap) if cap else own


_STAGES: dict = {}  # the stages a launch takes, by kernel, device, constexprs and options


def fit_key(fn, device_index: int, consts: dict) -> tuple:
    """A cache key for a launch's fit to the device's shared memory: the kernel, the device, the
    limit and the constexprs and options (by repr: True and 1 compile apart)."""
    return (fn, device_index, TUNE["shared_limit"], repr(sorted(consts.items())))


def too_big(what: str, shared: int, limit: int, smallest: str = "with one stage",
            advice: str = "smaller blocks (KVConfig's block_size), 16-bit inputs, or backend='reference'") -> SharedMemoryError:
    """The error of a launch whose kernel does not fit the device's shared memory even in its
    `smallest` form."""
    return SharedMemoryError(
        f"{what}: the Triton kernel needs {shared} bytes of shared memory a block even {smallest}, and this GPU allows {limit}; use {advice}")


TILE_MAX = 128  # tokens a step reads at most where a loop reads pages in tiles, unless asked for more (`page_tiles`)
SPILL_MAX = 64  # words of local memory (spilled registers) a thread a tile's kernel may take before a smaller tile is tried


def page_tiles(block_size: int, option: str) -> list[int]:
    """Tokens of a page a loop step may read (TUNE[option]), largest first: the page or, past
    TILE_MAX tokens, TILE_MAX, and their halves down to 16 (0, "auto"); or the one tile asked
    for (a page's size or more: the whole page)."""
    tile = TUNE[option]
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0 or (tile and (tile < 16 or tile & (tile - 1))):
        raise ValueError(f"TUNE[{option!r}] must be 0 (auto) or a power of two >= 16, got {tile!r}")
    if tile:
        return [min(tile, block_size)]
    top = min(block_size, TILE_MAX)
    return [top >> i for i in range(top.bit_length()) if top >> i >= 16]


def compiled_fit(fn, grid, args, consts: dict, limit: int) -> tuple[int, int | None]:
    """(shared memory a block, local memory words a thread) of `fn`'s kernel compiled for `args`
    with `consts` (warmed up, not launched); the words None where the shared memory is over
    `limit` (the binary is then not loaded: Triton refuses to load one over the device's)."""
    kernel = fn.warmup(*args, grid=grid, **consts)
    if kernel.metadata.shared > limit:
        return kernel.metadata.shared, None
    return kernel.metadata.shared, getattr(loaded(kernel), "n_spills", None) or 0


def fit_tile(compiled, tiles: list[int], stages: int, limit: int, what: str, advice: str) -> tuple[int, int]:
    """(tile, stages) of a loop that reads pages in tiles: the largest of `tiles`, in the most
    stages (`stages` at most), whose kernel fits `limit` bytes of shared memory and spills at
    most SPILL_MAX words a thread; where every one that fits spills more, the one that spills
    least; SharedMemoryError where not even the smallest tile fits in one stage.
    compiled(tile, stages) gives (shared bytes, local words or None where over the limit). A
    larger tile before more stages: the prefill kernel's tiles of 32 in two stages lost 20-41 %
    to tiles of 128 in one under a 99 KiB limit on the H200."""
    least = None  # (spills, tile, stages) of the fitting ones, the first best
    for tile in tiles:
        for n in range(stages, 0, -1):
            need, spills = compiled(tile, n)
            if spills is not None:
                if spills <= SPILL_MAX:
                    return tile, n
                if least is None or spills < least[0]:
                    least = (spills, tile, n)
    if least is None:
        raise too_big(what, need, limit, f"with one stage and tiles of {tiles[-1]} tokens", advice)
    return least[1], least[2]


def stages_that_fit(fn, grid, args, consts: dict, device_index: int, what: str) -> int:
    """num_stages for a launch of `fn` with `consts` (its constexprs and options, num_stages
    among them): theirs where the compiled kernel's shared memory fits the device
    (`shared_limit`), else the most below it that fits. Copies in flight take shared memory a
    stage; sm_86 and sm_89 cards (RTX 3090, 4090) allow 99 KiB a block and sm_80 163, where the
    H200 the stages were chosen on allows 227: pages of 256 tokens in two stages do not fit
    there. Raises SharedMemoryError, naming the sizes, where even one stage does not. `args`
    may be a callable that gives them (built only where the choice is not cached yet). The
    error is cached too: a kernel that does not fit is not compiled again."""
    key = fit_key(fn, device_index, consts)
    stages = _STAGES.get(key)
    if stages is None:
        limit = shared_limit(device_index)
        args = args() if callable(args) else args
        for stages in range(consts.get("num_stages") or 3, 0, -1):
            shared = fn.warmup(*args, grid=grid, **dict(consts, num_stages=stages)).metadata.shared  # (compiled, not launched)
            if shared <= limit:
                break
        else:
            stages = too_big(what, shared, limit)
        _STAGES[key] = stages
    if isinstance(stages, SharedMemoryError):
        raise stages
    return stages


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def loaded(kernel):
    """A compiled (warmed-up) kernel with its binary loaded, which reports its registers
    (n_regs) and local memory (n_spills, words a thread)."""
    if getattr(kernel, "n_regs", None) is None and hasattr(kernel, "_init_handles"):
        kernel._init_handles()
    return kernel


def kernel_fit(kernel, num_warps: int, device: int) -> int:
    """programs_fit of a compiled (warmed-up) decode kernel on `device`."""
    regs = getattr(loaded(kernel), "n_regs", None)
    if regs is None:  # a Triton that does not say: no limit from it
        return 32
    return programs_fit(regs, kernel.metadata.shared, num_warps, torch.cuda.get_device_properties(device))


@triton.jit
def _tiny_probe_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """C [M, N] fp32 = A [M, K] (int16 bits read as fp16) @ B [K, N] fp16, one tensor-core dot."""
    offs_m = tl.arange(0, M)
    offs_k = tl.arange(0, K)
    offs_n = tl.arange(0, N)
    a = tl.load(A + offs_m[:, None] * K + offs_k[None, :]).to(tl.float16, bitcast=True)
    b = tl.load(B + offs_k[:, None] * N + offs_n[None, :])
    tl.store(C + offs_m[:, None] * N + offs_n[None, :], tl.dot(a, b))


_TINY_OK: dict = {}  # by device: whether its dots multiply subnormal fp16 exactly


def tiny_codes_exact(device: torch.device) -> bool | None:
    """Whether `device`'s tensor-core dots multiply subnormal fp16 operands exactly, which the
    side loop's tiny codes rely on (PTX leaves the handling of subnormal mma inputs unspecified;
    the H200 does). A probe dot of codes 0..255 as fp16 bits (c * 2^-24) against fp16 values of
    the scales' magnitudes, one warp as the side loop's dots, against fp64; run once a device
    and cached. None (not cached) while a CUDA graph is being captured on the current stream,
    where the probe cannot wait for its result."""
    key = _device_key(device)
    if key in _TINY_OK:
        return _TINY_OK[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    codes, b = _tiny_probe_inputs()
    out = torch.empty(16, 16, dtype=torch.float32, device=device)
    _tiny_probe_kernel[(1,)](codes.to(device), b.to(device), out, 16, 32, 16, num_warps=1, **TRITON_OPTIONS)
    ok = _tiny_probe_verdict(out.cpu(), codes, b)
    _TINY_OK[key] = ok
    return ok


def _device_key(device: torch.device) -> str:
    """A device's key in _TINY_OK, with its index: "cuda" (the current device) keys as "cuda:0"
    would when that device is 0."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _tiny_probe_inputs():
    """The probe's codes [16, 32] (0..255, int16) and fp16 values [32, 16] (columns from 1e-4 to
    10 in magnitude, as q*s spans)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (16, 32), generator=g, dtype=torch.int16)
    b = (torch.randn(32, 16, generator=g) * torch.logspace(-4, 1, 16)).to(torch.float16)
    return codes, b


def _tiny_probe_verdict(out: torch.Tensor, codes: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the probe's dot `out` is (codes * 2^-24) @ b to fp32 accumulation (1e-5 of the
    sum of the terms' magnitudes): a flushed or truncated subnormal operand is far off."""
    a = codes.double() * 2.0**-24
    return bool(((out.double() - a @ b.double()).abs() <= 1e-5 * (a @ b.double().abs())).all())


