"""`bench decode`: per-layer time of one decode step (q_len=1) of each KV format against peer
kernels, in one process.

Each time is the median over repetitions of a loop over enough copies of the layer's KV
(distinct memory) that the working set is far larger than L2. Peers: SDPA over dense bf16 K/V
(PyTorch's flash kernel), FlexAttention paged over bf16 pages (the `flex` backend, eager
timing only), flash-attn's own paged decode over bf16 pages of 256 tokens (where flash-attn
imports), and "dequantize everything, then SDPA" (how Hugging Face's QuantizedCache reads its
cache). Where flash-attn imports, each quantized format also gets a row of our `flash` backend
(the past dequantized into bf16 pages a bounded slice at a time, then flash-attn's paged kernel)
beside its triton row. Results are dataclasses; the CLI renders them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..config import KVConfig
from ..ops.backend import flash_available
from ..ops.pages import PagedView
from .common import (fit_copies, free_bytes, no_room, out_of_memory, bench_setup, time_calls, time_graph, copy_view, synthetic_view,
                     view_bytes, view_nbytes)


@dataclass
class DecodeRow:
    name: str  # format or peer
    context: int
    batch: int
    ms: float  # per layer, median
    kv_bytes: int  # bytes of K/V (codes, scales, dense) one step must read
    ratio_to_sdpa: float = float("nan")  # SDPA dense bf16 time / this time (>1: faster)
    note: str = ""  # why a row has no time (ms nan): out of GPU memory, a peer that failed

    @property
    def tb_per_s(self) -> float:
        return self.kv_bytes / (self.ms / 1e3) / 1e12

    def as_dict(self) -> dict:
        return {**asdict(self), "tb_per_s": self.tb_per_s}


def _error_line(e: BaseException) -> str:
    """An error for a row's note: its type and the first line of its message (at most 80
    characters; a message may be empty)."""
    first = str(e).splitlines()[:1]
    return f"{type(e).__name__}: {first[0][:80]}" if first else type(e).__name__


def dense_bytes_of(B: int, T: int, H: int, D: int) -> int:
    """Bytes of dense bf16 K and V: what SDPA reads a step, and what dequantizing all allocates."""
    return 2 * B * T * H * D * 2


def pages_bytes(B: int, T: int, H: int, D: int, cfg: KVConfig) -> tuple[int, int]:
    """(bytes a step reads, bytes a copy holds) of the bench's view in `cfg`, from a view on the
    "meta" device: known before a copy is drawn."""
    sized = synthetic_view(B, T, H, D, cfg, "meta")
    return view_bytes(sized), view_nbytes(sized)


def _fill(views: list[PagedView], n: int, B: int, T: int, H: int, D: int, cfg: KVConfig, device) -> None:
    """Appends to `views` a synthetic view and n - 1 copies of it, each in memory of its own. The
    list is the caller's, so that what was built before an out-of-memory error goes with it."""
    views.append(synthetic_view(B, T, H, D, cfg, device))
    views.extend(copy_view(views[0]) for _ in range(1, n))


def _timed_row(name: str, T: int, B: int, kv_bytes: int, measure) -> DecodeRow:
    """A row from `measure()` (its ms), or, when the GPU runs out of memory on the way, a row
    that says so and no time, the bench going on with the next."""
    try:
        return DecodeRow(name, T, B, measure(), kv_bytes)
    except Exception as e:
        if not out_of_memory(e):
            raise
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=f"out of GPU memory ({_error_line(e)})")


def decode_cases(contexts=(), batches=(), cases=None) -> list[tuple[int, int]]:
    """The (context, batch) pairs `bench_decode` runs, checked: `cases` in their order, or
    else every context at every batch size."""
    pairs = [(int(T), int(B)) for T, B in cases] if cases is not None else [(T, B) for B in batches for T in contexts]
    if not pairs:
        raise ValueError("bench decode needs at least one context and batch")
    for T, B in pairs:
        if T < 1 or B < 1:
            raise ValueError(f"contexts and batch sizes must be at least 1, got context {T} at batch {B}")
    return pairs


def bench_decode(
    contexts=(4096, 32768, 131072, 524288),
    batches=(1,),
    formats=("int4", "int8", "bf16"),
    shape: str = "llama-3-8b",
    block_size: int = 64,
    peers: bool = True,
    reps: int = 20,
    device: str = "cuda",
    progress=None,
    graph: bool = False,
    cases=None,
) -> list[DecodeRow]:
    """Per-layer decode latency of each format and peer, for every (context, batch), or for
    each (context, batch) pair of `cases` in turn when given (instead of the cross product:
    e.g. batch 1 at 128k and 512k with batch 8 at 32k in one process).
    graph=True times CUDA-graph replays of every kernel, peers included (no launch overhead).

    Each row times copies of its KV in distinct memory (see `copies_for`), as many as fit in the
    GPU's free memory; a row that does not fit at all gets no time and a note saying what it
    needed, and the bench goes on with the next row."""
    import torch.nn.functional as F

    from ..ops.gather_dequant import gather_dequant
    from ..ops.paged_attention import paged_attention

    pairs = decode_cases(contexts, batches, cases)
    cfgs, Hq, H, D = bench_setup("decode", formats, block_size, shape)
    timer = time_graph if graph else time_calls
    flash = torch.device(device).type == "cuda" and flash_available()
    rows: list[DecodeRow] = []
    for T, B in pairs:
        q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.bfloat16)
        case: list[DecodeRow] = []
        dense_bytes = dense_bytes_of(B, T, H, D)
        if peers:
            case.append(_sdpa_row(q, T, B, H, D, timer, reps))
            if not graph:
                case.append(_flex_row(q, B, T, H, D, block_size, reps))
            if flash:
                case.append(_flash_attn_row(q, T, B, H, D, timer, reps))
        for name, cfg in cfgs.items():
            label, (kv_bytes, copy_bytes) = f"longctx {cfg.describe()}", pages_bytes(B, T, H, D, cfg)
            deq = "dequantize-all then SDPA (int4)" if peers and name == "int4" else None
            free = free_bytes(device)
            L = fit_copies(copy_bytes, free)
            if not L:
                case.append(DecodeRow(label, T, B, float("nan"), kv_bytes, note=no_room(copy_bytes, free)))
                if deq:
                    case.append(DecodeRow(deq, T, B, float("nan"), kv_bytes, note=no_room(copy_bytes, free, dense_bytes)))
                continue
            views: list[PagedView] = []

            def attend():
                _fill(views, L, B, T, H, D, cfg, device)
                return timer(lambda i: paged_attention(q, views[i], backend="triton", return_lse=False), L, reps)

            case.append(_timed_row(label, T, B, kv_bytes, attend))
            if flash and cfg.key_bits < 16 and len(views) == L:
                case.append(_flash_backend_row(q, views, label, T, B, kv_bytes, copy_bytes, free, timer, reps))
            if deq and len(views) == L:
                # the same copies, as many as leave room for one call's dense K and V
                n = min(L, fit_copies(copy_bytes, free, dense_bytes))
                del views[n:]
                if not n:
                    case.append(DecodeRow(deq, T, B, float("nan"), kv_bytes, note=no_room(copy_bytes, free, dense_bytes)))
                else:
                    def deq_all(i):
                        k, v = gather_dequant(views[i], out_dtype=torch.bfloat16)
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                    case.append(_timed_row(deq, T, B, kv_bytes, lambda: timer(deq_all, n, max(3, reps // 4))))
            elif deq:
                case.append(DecodeRow(deq, T, B, float("nan"), kv_bytes, note=case[-1].note))
            views.clear()  # (the copies, before the allocator is emptied)
            torch.cuda.empty_cache()
        base = next((r.ms for r in case if r.name == "SDPA dense bf16"), float("nan"))
        for r in case:
            r.ratio_to_sdpa = base / r.ms
        rows.extend(case)
        if progress is not None:
            progress(case)
    return rows


def _sdpa_row(q, T: int, B: int, H: int, D: int, timer, reps: int) -> DecodeRow:
    """The SDPA dense bf16 peer (PyTorch's flash kernel over dense K/V), the rows' base."""
    import torch.nn.functional as F

    name, dense_bytes = "SDPA dense bf16", dense_bytes_of(B, T, H, D)
    L = fit_copies(dense_bytes, free := free_bytes(q.device))
    if not L:
        return DecodeRow(name, T, B, float("nan"), dense_bytes, note=no_room(dense_bytes, free))
    kvs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def measure():
        kvs.extend((torch.randn(B, H, T, D, device=q.device, dtype=torch.bfloat16), torch.randn(B, H, T, D, device=q.device, dtype=torch.bfloat16))
                   for _ in range(L))
        return timer(lambda i: F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], enable_gqa=True), L, reps)

    try:
        return _timed_row(name, T, B, dense_bytes, measure)
    finally:
        kvs.clear()
        torch.cuda.empty_cache()


FLASH_ATTN_PAGE = 256  # flash-attn 2's paged kernel takes pages of a multiple of 256 tokens


def flash_attn_pages(B: int, T: int, H: int, D: int, device, seed: int | None = None):
    """Random bf16 K and V for flash-attn's paged decode: pages of 256 tokens (FA2's page
    size), [B * pages a row, 256, H, D] each, at shuffled pool slots, and the block table
    [B, pages a row] (int32) that gives row b's pages in order. The bench's flash-attn peer
    times these; a test gathers them back into dense K/V."""
    P = FLASH_ATTN_PAGE
    n = -(-T // P)
    g = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    k, v = (torch.randn(B * n, P, H, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    return k, v, torch.randperm(B * n, device=device, generator=g).to(torch.int32).reshape(B, n)


def _flash_attn_row(q, T: int, B: int, H: int, D: int, timer, reps: int) -> DecodeRow:
    """The flash-attn paged bf16 peer: `flash_attn_with_kvcache` over bf16 pages of 256 tokens
    through a block table (`flash_attn_pages`): flash-attn's own paged decode, not the `flash`
    backend (which stages quantized pages for it). A flash-attn that fails to import or to run
    is reported in the row's note (time nan), not raised."""
    name, dense_bytes = "flash-attn paged bf16", dense_bytes_of(B, T, H, D)
    copy_bytes = 2 * B * -(-T // FLASH_ATTN_PAGE) * FLASH_ATTN_PAGE * H * D * 2
    L = fit_copies(copy_bytes, free := free_bytes(q.device))
    if not L:
        return DecodeRow(name, T, B, float("nan"), dense_bytes, note=no_room(copy_bytes, free))
    caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def measure():
        from flash_attn import flash_attn_with_kvcache

        qt = q.transpose(1, 2).contiguous()  # flash-attn's [B, 1, H_q, D]
        seqlens = torch.full((B,), T, dtype=torch.int32, device=q.device)
        caches.extend(flash_attn_pages(B, T, H, D, q.device) for _ in range(L))
        return timer(lambda i: flash_attn_with_kvcache(qt, caches[i][0], caches[i][1], cache_seqlens=seqlens, block_table=caches[i][2]), L, reps)

    return _peer_row(name, T, B, dense_bytes, measure, caches)


def _flash_backend_row(q, views: list, label: str, T: int, B: int, kv_bytes: int, copy_bytes: int, free: int, timer, reps: int) -> DecodeRow:
    """Our `flash` backend over the format row's copies `views` (as many as leave room for its
    staging pages): each step dequantizes the past into bf16 pages of 256 tokens, a bounded slice
    at a time, then runs flash-attn's paged kernel on them. A failure is the row's note (`_peer_row`);
    the copies stay the format row's."""
    from ..ops.paged_attention import paged_attention
    from ..ops.paged_attention.flash import STAGE_BYTES

    name, fmt = f"{label}, flash backend", views[0].pages.fmt
    staging = min(STAGE_BYTES, dense_bytes_of(B, T, fmt.num_kv_heads, fmt.head_dim))
    n = min(len(views), fit_copies(copy_bytes, free, staging))
    if not n:
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=no_room(copy_bytes, free, staging))
    return _peer_row(name, T, B, kv_bytes, lambda: timer(lambda i: paged_attention(q, views[i], backend="flash", return_lse=False), n,
                                                         max(3, reps // 4)), [])


def _flex_row(q, B: int, T: int, H: int, D: int, block_size: int, reps: int) -> DecodeRow:
    """The FlexAttention paged bf16 peer (backend "flex" over 16-bit pages). A failure to
    compile or run is reported in the row's note (time nan), not raised."""
    from ..ops.paged_attention import paged_attention

    name, cfg = "FlexAttention paged bf16", KVConfig(bits=16, block_size=block_size)
    kv_bytes, copy_bytes = pages_bytes(B, T, H, D, cfg)
    L = fit_copies(copy_bytes, free := free_bytes(q.device))
    if not L:
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=no_room(copy_bytes, free))
    views: list[PagedView] = []

    def measure():
        _fill(views, L, B, T, H, D, cfg, q.device)
        return time_calls(lambda i: paged_attention(q, views[i], backend="flex", return_lse=False), L, reps)

    return _peer_row(name, T, B, kv_bytes, measure, views)


def _peer_row(name: str, T: int, B: int, kv_bytes: int, measure, held: list) -> DecodeRow:
    """A peer's row from `measure()`: a peer that fails to import, compile or run gets its error
    in the row's note (time nan) instead of stopping the bench; the copies `measure` put in
    `held` are freed either way."""
    try:
        return _timed_row(name, T, B, kv_bytes, measure)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is a finding, shown in the table
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=f"failed ({_error_line(e)})")
    finally:
        held.clear()
        torch.cuda.empty_cache()
