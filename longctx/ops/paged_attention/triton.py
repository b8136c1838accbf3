"""The Triton decode launcher: paged_decode_triton plans a decode call over a view of the
pages (split count, loop shape, merge, constexprs), caches the plan by what decides it, and
launches the decode kernel (decode_kernel.py) and, where the splits need one, the merge launch
(merge.py). Rows that hold their first blocks alike (a prompt's beams) read those blocks in a
launch of their own whose programs take several rows' queries (`_decode_shared`).

The prefill launcher (prefill.py) shares `setup` and `kernel_consts`; the fit to the GPU
(stages, tiles, programs per SM) is tuning.py's. Never imports the reference; tests compare
the two (tests/ops/test_paged_attention_triton.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...errors import BackendUnavailableError, SharedMemoryError
from ...quant import hadamard_scale
from ..backend import TRITON_OPTIONS
from ..pages import PagedView, kernel_pools
from .decode_kernel import decode_kernel
from .merge import counters, merge_launch, merge_mode, merge_shape, merge_tree
from .tuning import TUNE, compiled_fit, fit_key, fit_tile, interpreting, kernel_fit, num_splits, page_tiles, shared_limit, sm_count
from .tuning import check_knobs, stages_that_fit, tiny_codes_exact


def sub_tiles(bits: int) -> int:
    """Sub-tiles of one side (the kernels' K_SUB/V_SUB): codes a load word, int16 words for 8
    and 4 bits, bytes for 2 (the side loop reads int2 codes as int16 words itself, two bytes'
    sub-tile r a word: codes.py's int2_words_f16 and int2_rows_f16)."""
    return 1 if bits == 16 else (16 if bits >= 4 else 8) // bits


def _words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return codes.view(torch.int16) if bits in (4, 8) else codes


def side_pages(fmt, short: bool) -> int:
    """Sealed pages a loop step side by side, one a warp (0: the 2-D loop): for pages of at
    most 8 bits on both sides, TUNE["side"] of them, or TUNE["side_short"] where a program gets
    at most two pages (short contexts). Pages of more than SIDE_TILE tokens, or whose K scale
    spans are shorter than the page, go as tiles of at most SIDE_TILE tokens and one span."""
    for name in ("side", "side_short"):
        if TUNE[name] not in (0, 1, 2, 4, 8) or isinstance(TUNE[name], bool):
            raise ValueError(f"TUNE[{name!r}] must be one of 0, 1, 2, 4, 8, got {TUNE[name]!r}")
    if not TUNE["side"] or max(fmt.k_bits, fmt.v_bits) > 8:
        return 0
    return TUNE["side_short"] if short else TUNE["side"]


class Setup(NamedTuple):
    """What both launchers derive from a query [B, H_q, C, D] and a view."""
    fmt: object
    q: torch.Tensor  # stride 1 along D
    table: torch.Tensor  # at least one column
    n_blocks: int
    n_sink: int  # sink blocks the table holds (at most n_blocks)
    tail_len: int
    total: int  # logical blocks: sinks, sealed pages, then the tail's
    device: int | None  # CUDA device index
    sm: int  # SMs to fill (4 off the GPU, where the interpreter runs)
    gpu: bool  # compiled for a GPU, not interpreted
    pools: tuple
    consts: dict | None  # the constexprs both kernels take (`kernel_consts`; None where not asked for)


def setup(q, view: PagedView, start, who: str, consts: bool = True) -> Setup:
    """What a launch takes from q and the view; with consts=False its constexprs are None
    (`kernel_consts` gives them: a cached decode plan holds its own)."""
    fmt = view.pages.fmt
    B = q.shape[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    table = view.block_table
    n_blocks = table.shape[1]
    if n_blocks == 0:
        table = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    tail_k, tail_v = view.tail_k, view.tail_v
    if tail_k.stride(-1) != 1 or tail_k.stride() != tail_v.stride():
        raise ValueError(f"{who}: tail_k/tail_v must be contiguous along D and strided alike")
    tail_len = tail_k.shape[2]
    total = n_blocks + (tail_len + fmt.block_size - 1) // fmt.block_size
    device = _device(q)
    sm = sm_count(device) if q.is_cuda else 4
    pools = kernel_pools(view, who, _words)
    gpu = q.is_cuda and not interpreting()
    return Setup(fmt, q, table, n_blocks, min(view.n_sink, n_blocks), tail_len, total, device, sm, gpu, pools,
                 kernel_consts(fmt, q, pools[3], start, gpu, who) if consts else None)


def kernel_consts(fmt, q, KS, start, gpu: bool, who: str) -> dict:
    """The constexprs both kernels take, from the format, q [B, H_q, ..., D], K's scales (KS,
    for their dtype) and whether rows start late."""
    per_v = sub_tiles(fmt.v_bits)
    if fmt.group_size % per_v:
        raise BackendUnavailableError(f"{who} needs group_size divisible by {per_v} at {fmt.v_bits} bits, got {fmt.group_size}")
    Hq, D = q.shape[1], q.shape[-1]
    dot = tl.float16 if q.dtype == torch.float16 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float32)
    half = dot != tl.float32
    # the 2-D loop's K: dequantized in 16 bits against a fixed 16-bit query (from 16-bit
    # scales; in fp16 from fp32 ones), or in fp32 for fp32 queries
    k16 = (3 if KS.dtype in (torch.float16, torch.bfloat16) else 2) if half else 0
    # bf16 holds 128 + c exactly for codes c < 128 (int4, int2), not int8's: int8 K dequantizes
    # in fp16 (bf16 scales and zeros convert exactly within fp16's normal range, 6.1e-5 to
    # 65504; smaller ones lose bits as subnormals, larger ones would overflow)
    kdt = tl.bfloat16 if KS.dtype == torch.bfloat16 and fmt.k_bits <= 4 else tl.float16
    return dict(H=fmt.num_kv_heads, G=Hq // fmt.num_kv_heads, D=D, P=fmt.block_size, K_BITS=fmt.k_bits, V_BITS=fmt.v_bits,
                GS=fmt.group_size, ROTATE=fmt.rotate, HAS_START=start is not None, DOT=dot, PREC="ieee" if not half else "tf32",
                K16=k16, V16=half, KDT=kdt, ASM=int(gpu), K_SUB=sub_tiles(fmt.k_bits), V_SUB=per_v,
                INV_SQRT_D=hadamard_scale(D) if fmt.rotate else 1.0, PTX=gpu, KG=fmt.k_span)


def _device(q) -> int | None:
    return q.device.index if q.device.index is not None else torch.cuda.current_device() if q.is_cuda else None


class Plan(NamedTuple):
    """What a decode launch derives from its shapes, dtypes, lengths and TUNE, apart from the
    tensors themselves (`_decode_plan`). The layers of a decode step launch alike, and so do
    the steps until the next block seals: `_PLANS` keeps plans by what decides them, so that a
    call's host work is its checks, its buffers and the launch."""
    splits: int
    bps: int  # logical blocks a split (whole loop steps)
    merged: bool  # one split: the kernel writes the final output
    mode: str  # how the splits merge (`merge_mode`): "kernel", "launch" or ""
    grid: tuple  # the decode launch's grid: (rows x KV heads, splits)
    counters: int  # int32 counters the launch takes (0: none; the table stands in)
    consts: dict  # the launch's keywords: constexprs and options
    merge: dict  # the merge launch's shape (`merge_shape`; {} unless mode is "launch")
    summary: dict  # the loop's choices by name (side, tile, short, tiny, tree, merge), for tests and `bench`


class _Part(NamedTuple):
    """One of the two launches of a decode call over rows that hold their first blocks alike
    (`_decode_shared`): its programs take `rows` rows' queries (R; > 1 for the shared blocks,
    read once for a group of rows), its splits start at logical block `first`, and its
    partials go to slots slot0 .. of the `slots` both launches fill a (row, query head)."""
    rows: int = 1
    first: int = 0
    slot0: int = 0
    slots: int = 0


_PLANS: dict = {}  # decode plans by their key (`paged_decode_triton`; and the shared launch's merge shapes), emptied when large
_PLANS_MAX = 1024
_FIT: dict = {}  # programs per SM that fit, by device, format and TUNE


def _plan_key(st: Setup, q, view: PagedView, start, splits, capturing: bool):
    """What decides a decode plan: the format, shapes and dtypes, the lengths (in blocks, and
    whether there are sink blocks and a tail), the split count asked for, graph capture, the
    device's probe for tiny codes (run here the first time, so that the first call's key is the
    next ones'), and TUNE (checked: `check_knobs`)."""
    check_knobs()
    tiny = tiny_codes_exact(q.device)
    return (st.fmt, tuple(q.shape), q.dtype, st.pools[3].dtype, start is None, st.device, st.gpu, st.total, st.n_blocks,
            st.n_sink, st.tail_len > 0, view.tail_len is None, view.n_blocks is None, splits, capturing, tiny, tuple(TUNE.items()))


def _decode_args(st: Setup, view: PagedView, start, scale, plan: Plan, part: _Part | None = None, bufs=None):
    """The decode launch's buffers and arguments under `plan`: (o, lse, out, lout, args). A
    part of a call (`_decode_shared`) writes its partials into bufs = (o, lse), whose slots
    both parts share."""
    q, fmt = st.q, st.fmt
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    c = plan.consts
    if c["SIDE_PAGES"] and 2 in (fmt.k_bits, fmt.v_bits):  # the side loop reads int2 codes as int16 words (codes.py's int2_*)
        for side, bits, codes, words in (("K", fmt.k_bits, st.pools[2], c["K16"] == 1),
                                         ("V", fmt.v_bits, st.pools[5], c["V_TRANSPOSED"] and fmt.group_size // c["V_SUB"] % 2 == 0)):
            if bits == 2 and words and codes.data_ptr() % 2:
                raise ValueError(f"paged_decode_triton: the int2 {side} codes are read as 16-bit words and must start at an even "
                                 f"address; this pool starts at an odd one (a view of a larger buffer?)")
    if part is not None:
        o, lse = bufs
        first, slot0, slots = part.first, part.slot0, part.slots
    else:
        o = torch.empty(B, Hq, plan.splits, D, dtype=q.dtype if plan.merged else torch.float32, device=q.device)
        lse = torch.empty(B, Hq, plan.splits, dtype=torch.float32, device=q.device)
        first, slot0, slots = 0, 0, plan.splits
    out, lout, count = o, lse, st.table
    if part is None and plan.splits > 1:
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
        lout = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
        if plan.counters:
            count = counters(q.device, plan.counters)
    tail_k, tail_v = view.tail_k, view.tail_v
    args = (st.q, st.table, start if start is not None else st.table,
            view.sink_k, view.sink_v, *st.pools, tail_k, tail_v,
            o, lse, out, lout, count,
            st.q.stride(0), st.q.stride(1), st.table.stride(0), tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
            st.n_blocks if view.n_blocks is None else view.n_blocks, st.n_sink, st.tail_len if view.tail_len is None else view.tail_len,
            plan.bps, scale, plan.splits, first, slot0, slots)
    return o, lse, out, lout, args


def _decode_plan(st: Setup, view: PagedView, start, scale, splits: int | None, capturing: bool,
                 part: _Part | None = None) -> tuple[Plan, bool]:
    """The launch plan of a decode call (split count, loop shape, merge, constexprs), and
    whether it may be cached (not while the tiny-code probe is still to run). Compiles the
    kernel where the split count depends on how many programs fit. A part of a call
    (`_decode_shared`: its rows a program and first block) leaves the merge to its caller."""
    fmt, q, sm, gpu, device = st.fmt, st.q, st.sm, st.gpu, st.device
    R, first = (part.rows, part.first) if part is not None else (1, 0)
    total = st.total - first  # the logical blocks this launch's splits share
    B, Hq, D = q.shape[0] // R, q.shape[1], q.shape[-1]
    H, G = fmt.num_kv_heads, st.consts["G"]
    KS = st.pools[3]
    half = st.consts["DOT"] != tl.float32
    sixteen = fmt.k_bits == 16 and fmt.v_bits == 16
    ppsm = TUNE["programs16"] if sixteen else TUNE["programs_per_sm"]
    guess = splits or num_splits(B, H, total, sm, ppsm)
    # programs of one or two pages (short contexts) have nothing for a third stage to prefetch
    short = not sixteen and math.ceil(total / guess) <= 2
    side = side_pages(fmt, short)
    opts = dict(num_warps=side or TUNE["num_warps"], **TRITON_OPTIONS)
    if R > 1 and side:  # the shared blocks' launch: a group's R x G queries over more warps (TUNE["shared_warps"])
        opts["num_warps"] = side * TUNE["shared_warps"]
    # side by side, K's per-channel scales fold into the query per page (16-bit inputs; fp32 in fp32)
    k16 = int(half) if side else st.consts["K16"]
    stages = TUNE["side_stages"] if side else TUNE["stages16"] if sixteen else TUNE["short_stages"] if short else TUNE["num_stages"]
    opts["num_stages"] = stages
    if side:
        ppsm = TUNE["side_programs"]
        guess = splits or num_splits(B, H, total, sm, ppsm)
    pages_per_step = side or 1
    # the 2-D loop in tiles of a page: the one TUNE["loop_tile"] asks for, or (auto, on a GPU,
    # `fit_stages`) the largest that fits where whole pages do not
    tiles = loop_tiles(fmt.block_size)  # (checks TUNE["loop_tile"] whichever loop the pages take)
    if side:
        tiles = []
    td = tiles[0] if tiles and TUNE["loop_tile"] else 0
    rows = max(TUNE["side_rows"] if side else 16, triton.next_power_of_2(R * G))  # (triton pads a dot's M < 16 itself)
    # values transposed, their scales folded into the fp16 probabilities (16-bit inputs only)
    v_transposed = bool(side and half)
    # (the probe runs only where a side loop's dots would take tiny codes)
    tiny = tiny_codes_exact(q.device) if side and half else False
    consts = dict(st.consts, K16=k16, G_PAD=rows, SIDE_PAGES=side, V_TRANSPOSED=v_transposed,
                  # V's zero-point term as a small dot: faster for 4-bit values, slower for 8-bit
                  ZERO_DOT=v_transposed and fmt.v_bits <= 4,
                  # programs with no sink page and no tail skip those loops, but short programs measured slower so
                  SKIP=bool(side) and not short,
                  DENSE=min(TUNE["side_dense"], fmt.block_size) if side else td, TD=td,
                  # one page a step with no left padding masks no score: leave the masking out (faster at 4 bits, not 8)
                  MASK=not (side == 1 and start is None and max(fmt.k_bits, fmt.v_bits) <= 4),
                  TINY_CODES=bool(tiny), G_MERGE=triton.next_power_of_2(G), MERGE_STEP=max(1, 4096 // (triton.next_power_of_2(G) * D)),
                  TAIL_DEV=view.tail_len is not None, BLOCKS_DEV=view.n_blocks is not None, R=R, **opts)
    summary = dict(side=side, tile=td, k16=k16, v_transposed=v_transposed, zero_dot=consts["ZERO_DOT"], skip=consts["SKIP"], short=short,
                   mask=consts["MASK"], tiny=consts["TINY_CODES"])

    def mode_at(splits: int) -> str:
        """How the splits merge (`merge_mode`); "" where there is nothing to merge or the caller
        merges (a part)."""
        return merge_mode(capturing) if splits > 1 and part is None else ""

    def plan_for(splits: int) -> Plan:
        """The plan at (about) `splits` splits: whole loop steps a split, so the count may fall."""
        bps = pages_per_step * max(1, math.ceil(total / splits / pages_per_step))  # whole steps per split
        splits = max(1, math.ceil(total / bps))
        mode = mode_at(splits)
        tree = merge_tree(splits) if mode == "kernel" else 0
        # a counter per (row, KV head); with a tree one per group, and one for the groups
        n_counters = B * H * (math.ceil(splits / tree) + 1 if tree else 1) if mode == "kernel" else 0
        return Plan(splits, bps, splits == 1 and part is None, mode, (B * H, splits), n_counters,
                    dict(consts, MERGE=mode == "kernel", TREE=tree),
                    merge_shape(B, Hq, D, sm, splits) if mode == "launch" else {},
                    dict(summary, tree=tree, merge=mode, splits=splits, num_warps=consts["num_warps"], num_stages=consts["num_stages"]))

    def fit_for(splits: int) -> int:
        """Programs of the compiled kernel (its merge mode at `splits`) one SM holds (GPU)."""
        key = (device, fmt, q.dtype, KS.dtype, start is not None, view.tail_len is None, view.n_blocks is None, mode_at(splits), stages,
               side, consts["TD"], R, tuple(TUNE.items()))
        fit = _FIT.get(key)
        if fit is None:  # (the in-kernel merge costs registers: 165 against 128 on triton 3.6)
            plan = plan_for(splits)
            args = _decode_args(st, view, start, scale, plan)[-1]
            fit = _FIT[key] = kernel_fit(decode_kernel.warmup(*args, grid=plan.grid, **plan.consts), opts["num_warps"], device)
        return fit

    def fit_stages(plan: Plan) -> bool:
        """Fewer stages where the plan's kernel does not fit the device's shared memory, or
        for the 2-D loop (TUNE["loop_tile"] auto) tiles of its pages where whole pages do not
        fit in one stage; whether that changed them (plans made since take them)."""
        nonlocal stages
        try:
            fits = stages_that_fit(decode_kernel, plan.grid, lambda: _decode_args(st, view, start, scale, plan)[-1], plan.consts, device,
                                   "paged_decode_triton")
        except SharedMemoryError:
            if not tiles or TUNE["loop_tile"] or plan.consts["TD"]:
                raise
            tile, fits = _loop_fit(plan.grid, _decode_args(st, view, start, scale, plan)[-1], plan.consts, tiles, device)
            consts.update(TD=tile, DENSE=tile)
            summary["tile"] = tile
        else:
            if fits == plan.consts.get("num_stages"):
                return False
        stages = opts["num_stages"] = consts["num_stages"] = fits
        return True

    if gpu:
        fit_stages(plan_for(guess))
    if splits is None:
        splits = guess
        if gpu:  # as many programs per SM as fit, given the compiled kernel's registers
            fit = fit_for(splits)
            if fit < ppsm:
                splits = num_splits(B, H, total, sm, fit)
    plan = plan_for(splits)
    if gpu and fit_stages(plan):  # (another merge mode than the guess's)
        plan = plan_for(splits)
    # not cached while the probe is still to run (under graph capture)
    return plan, tiny is not None


LOOP_TILE_MAX = 64  # tokens a tile of the 2-D loop's auto choice at most (`loop_tiles`; docs/kernels.md)


def loop_tiles(block_size: int) -> list[int]:
    """Tiles of a page the 2-D decode loop may read, largest first, none of them the whole page:
    TUNE["loop_tile"]'s where set (none where that is a page or more), else the page's halves
    of at most LOOP_TILE_MAX tokens down to 16 (tiles of 128 ran 24 % slower than 64 on the
    H200, whole pages as fast as 64)."""
    asked = TUNE["loop_tile"]
    return [t for t in page_tiles(block_size, "loop_tile") if t < block_size and (asked or t <= LOOP_TILE_MAX)]


_LOOP_TILES: dict = {}  # the tile and stages of a 2-D loop whose whole pages do not fit, by its constexprs, tiles and dtypes


def _loop_fit(grid, args, consts: dict, tiles: list[int], device: int) -> tuple[int, int]:
    """(tile, stages) of a decode launch through the 2-D loop whose whole pages do not fit the
    device's shared memory even in one stage: `fit_tile`'s choice among `tiles` (`loop_tiles`),
    cached. fp32 queries over 16-bit pages of 256 tokens, compiled for sm_89: whole pages
    155,712 bytes in one stage, over an RTX 3090's or 4090's 101,376; tiles of 64 78,080."""
    key = (fit_key(decode_kernel, device, consts), tuple(tiles), tuple(getattr(a, "dtype", None) for a in args))
    fit = _LOOP_TILES.get(key)
    if fit is None:
        limit = shared_limit(device)

        def compiled(tile: int, stages: int):
            return compiled_fit(decode_kernel, grid, args, dict(consts, TD=tile, DENSE=tile, num_stages=stages), limit)

        fit = _LOOP_TILES[key] = fit_tile(compiled, tiles, consts.get("num_stages") or 3, limit, "paged_decode_triton",
                                          "smaller blocks (KVConfig's block_size), 16-bit inputs, or backend='reference'")
    return fit


def shared_rows(batch: int, G: int, shared_blocks: int, block_size: int, run: int = 0) -> int:
    """Rows a program of the shared blocks' launch takes (R; 1: no such launch, the call reads
    whole rows): where the rows of each run of `run` consecutive rows (0: all `batch` rows)
    hold their first `shared_blocks` blocks alike (a prompt's under its beams) and they are at
    least TUNE["shared_from"] tokens, the largest divisor of the run from 2 whose queries (R x
    G a KV head) stay within TUNE["shared_rows"]."""
    for name in ("shared_from", "shared_rows", "shared_warps"):
        v = TUNE[name]
        least = int(name == "shared_warps")
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"TUNE[{name!r}] must be an int >= {least}, got {v!r}")
    if not TUNE["shared_from"] or shared_blocks * block_size < TUNE["shared_from"]:
        return 1
    run = run or batch
    if batch % run:
        raise ValueError(f"shared_rows: runs of {run} rows do not divide a batch of {batch}")
    for r in range(min(run, TUNE["shared_rows"] // max(1, G)), 1, -1):
        if run % r == 0:
            return r
    return 1


def _decode_shared(st: Setup, view: PagedView, start, scale, R: int, capturing: bool, key):
    """Decode over rows whose first view.shared blocks are the same ids within each run of
    view.shared_run rows (beams over their prompt; R divides the run): a launch over those
    blocks whose programs take the queries of R rows at once, so that a group of rows reads
    them once (the GPU's L2 does not spare the repeats: four rows sharing 128k tokens took 146
    us a layer against 48 for one); a launch over each row's other blocks and tail; one merge
    of both launches' partials. -> (out [B, H_q, 1, D], lse [B, H_q, 1])."""
    q = st.q
    B, Hq, D = q.shape
    c, st_s, view_s, plans = _shared_plans(st, view, start, scale, R, capturing, key)
    S = plans[0].splits + plans[1].splits
    o = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    for s, v, plan, part in ((st_s, view_s, plans[0], _Part(R, 0, 0, S)), (st, view, plans[1], _Part(1, c, plans[0].splits, S))):
        args = _decode_args(s, v, start, scale, plan, part, (o, lse))[-1]
        decode_kernel[plan.grid](*args, **plan.consts)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    lout = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
    mk = (key, "merge", R, c)
    merge = _PLANS.get(mk)
    if merge is None:
        merge_mode(capturing)  # (checks TUNE["merge"])
        merge = _PLANS[mk] = merge_shape(B, Hq, D, st.sm, S)
    merge_launch(o, lse, out, lout, S, merge)
    return out, lout


def _shared_plans(st: Setup, view: PagedView, start, scale, R: int, capturing: bool, key):
    """The two launches of `_decode_shared`: (c, the shared blocks' setup and view, [their plan,
    the rest's plan]), c the blocks the rows share (the first launch reads no tail)."""
    c = min(view.shared, st.n_blocks)
    st_s = st._replace(n_blocks=c, n_sink=min(st.n_sink, c), tail_len=0, total=c)
    view_s = dataclasses.replace(view, tail_k=view.tail_k[:, :, :0], tail_v=view.tail_v[:, :, :0], tail_len=None, n_blocks=None)
    plans = [_cached_plan((key, name, R, c), s, v, start, scale, None, capturing, part)
             for name, s, v, part in (("shared", st_s, view_s, _Part(R, 0)), ("rest", st, view, _Part(1, c)))]
    return c, st_s, view_s, plans


def _cached_plan(key, st: Setup, view: PagedView, start, scale, splits, capturing: bool, part: _Part | None = None) -> Plan:
    """`_decode_plan`'s plan, from `_PLANS` by `key` where it was made before, else made (with
    the setup's constexprs where it has none) and kept."""
    plan = _PLANS.get(key)
    if plan is None:
        if st.consts is None:
            st = st._replace(consts=kernel_consts(st.fmt, st.q, st.pools[3], start, st.gpu, "paged_decode_triton"))
        plan, cacheable = _decode_plan(st, view, start, scale, splits, capturing, part)
        if cacheable:
            if len(_PLANS) >= _PLANS_MAX:  # (a plan per block count: long generations would pile them up)
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def decode_plans(q, view: PagedView, start=None, scale: float | None = None, splits: int | None = None) -> list[Plan]:
    """The plans a `paged_decode_triton` call with these arguments launches under (one, or the
    shared blocks' and the rest's), made and cached as the call would; no kernel runs. For
    tests and benches that check which loop, tiles and split count a shape gets."""
    st = setup(q[:, :, 0], view, start, "paged_decode_triton", consts=False)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    key = _plan_key(st, q, view, start, splits, capturing)
    R = _shared_rows_of(q, view, st, splits)
    if R > 1:
        return _shared_plans(st, view, start, scale, R, capturing, key)[3]
    return [_cached_plan(key, st, view, start, scale, splits, capturing)]


def _shared_rows_of(q, view: PagedView, st: Setup, splits) -> int:
    """R for a call (`shared_rows`), 1 for one row or an asked-for split count."""
    if not view.shared or q.shape[0] == 1 or splits is not None:
        return 1
    return shared_rows(q.shape[0], q.shape[1] // st.fmt.num_kv_heads, min(view.shared, st.n_blocks), st.fmt.block_size, view.shared_run)


def paged_decode_triton(q, view: PagedView, start, scale, return_lse: bool = True, splits: int | None = None):
    """q [B, H_q, 1, D] -> (out [B, H_q, 1, D], lse [B, H_q, 1] fp32 or None), over pages
    [N_blk, H_kv, P, D * bits / 8] of the view's pools. Where the view's rows share their first
    blocks (view.shared) the call takes two launches (`_decode_shared`), unless `splits` asks for
    a split count (tests)."""
    st = setup(q[:, :, 0], view, start, "paged_decode_triton", consts=False)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    key = _plan_key(st, q, view, start, splits, capturing)
    R = _shared_rows_of(q, view, st, splits)
    if R > 1:
        out, lout = _decode_shared(st, view, start, scale, R, capturing, key)
        return out, (lout if return_lse else None)
    plan = _cached_plan(key, st, view, start, scale, splits, capturing)
    o, lse, out, lout, args = _decode_args(st, view, start, scale, plan)
    decode_kernel[plan.grid](*args, **plan.consts)
    if plan.merged:
        return o, (lse if return_lse else None)
    if plan.mode == "launch":
        merge_launch(o, lse, out, lout, plan.splits, plan.merge)
    return out, (lout if return_lse else None)


def compiled_kernel(plan: Plan, q, view: PagedView, start=None):
    """The decode kernel compiled (not launched) for `plan` over q and the view of a whole-row
    call (`decode_plans`): its registers (n_regs, once loaded), shared memory and warps, for
    tests and benches that check a launch's fit."""
    st = setup(q[:, :, 0], view, start, "paged_decode_triton", consts=False)
    return decode_kernel.warmup(*_decode_args(st, view, start, q.shape[-1] ** -0.5, plan)[-1], grid=plan.grid, **plan.consts)
