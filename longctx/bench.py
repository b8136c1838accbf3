"""Decode-attention benchmark: longctx formats against peer kernels, in one process.

Per-layer time of one decode step (q_len=1), the median over repetitions of a loop over
enough copies of the layer's KV (distinct memory) that the working set is far larger than
L2. Peers: SDPA over dense bf16 K/V (PyTorch's flash kernel), FlexAttention paged over bf16
pages (the `flex` backend, eager timing only), and "dequantize everything, then SDPA" (how
Hugging Face's QuantizedCache reads its cache). Results are dataclasses;
the CLI renders them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from .config import KVConfig, kv_preset
from .errors import BackendUnavailableError
from .ops.pages import Pages, PagedView
from .quant import BlockFormat

LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128, layers=32)
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64, layers=30)
SHAPES = {"llama-3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2}
# the benches take the named KV formats (longctx/configs/kv.yaml) at their block size; "int2"
# is int2+rot (2-bit pages are rotated), the name they took before the formats were shared
_ALIASES = {"int2": "int2+rot"}


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


def synthetic_view(batch: int, context: int, kv_heads: int, head_dim: int, cfg: KVConfig, device, dtype=torch.bfloat16, seed: int = 0) -> PagedView:
    """A paged batch of `context` tokens per row with random codes and scales: one sink
    block, sealed blocks at shuffled pool slots, and a half-full tail. On the "meta" device,
    the same tensors without values: what a view of that size takes (`view_nbytes`)."""
    cfg = cfg.resolve(1, head_dim)
    P, H, D = cfg.block_size, kv_heads, head_dim
    g = torch.Generator(device="cpu").manual_seed(seed)
    tail = P // 2
    n_blocks = max(1, (context - tail) // P)
    fmt = BlockFormat(*cfg.layer_bits(0), P, cfg.group_size, D, H, dtype, cfg.rotate)
    n = batch * n_blocks
    pages = Pages(fmt)
    sized = torch.device(device).type == "meta"

    def rnd(*shape):
        return torch.empty(shape, dtype=dtype, device=device) if sized else (torch.randn(*shape, generator=g) * 0.5).to(dtype).to(device)

    def codes(*shape):
        return torch.empty(shape, dtype=torch.uint8, device=device) if sized else torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)

    if fmt.k_bits == 16:
        pages.k = rnd(n, H, P, D)
    else:
        pages.k_codes = codes(n, H, P, D * fmt.k_bits // 8)
        pages.k_scale, pages.k_zero = rnd(n, H, D).abs() * 0.1, rnd(n, H, D)
    if fmt.v_bits == 16:
        pages.v = rnd(n, H, P, D)
    else:
        pages.v_codes = codes(n, H, P, D * fmt.v_bits // 8)
        pages.v_scale, pages.v_zero = rnd(n, H, P, D // fmt.group_size).abs() * 0.1, rnd(n, H, P, D // fmt.group_size)
    table = torch.randperm(n, generator=g).to(torch.int32).reshape(batch, n_blocks)
    ns = min(cfg.sink_blocks, n_blocks)
    table[:, :ns] = torch.arange(batch * ns, dtype=torch.int32).reshape(batch, ns)
    sink_k, sink_v = rnd(max(1, batch * ns), H, P, D), rnd(max(1, batch * ns), H, P, D)
    return PagedView(pages, sink_k, sink_v, table.to(device), ns, rnd(batch, H, tail, D), rnd(batch, H, tail, D))


def copy_view(view: PagedView) -> PagedView:
    """`view` in fresh memory on its device. The timed copies of a view are there to defeat
    the L2 cache by their addresses, not their values: cloning one on the device spares
    drawing each on the host (~3 GB a format and case, seconds each)."""
    pages = Pages(view.pages.fmt, **{name: t.clone() for name, t in view.pages.tensors().items()})
    return replace(view, pages=pages, sink_k=view.sink_k.clone(), sink_v=view.sink_v.clone(), block_table=view.block_table.clone(),
                   tail_k=view.tail_k.clone(), tail_v=view.tail_v.clone(),
                   tail_len=None if view.tail_len is None else view.tail_len.clone(),
                   n_blocks=None if view.n_blocks is None else view.n_blocks.clone())


def view_nbytes(view: PagedView) -> int:
    """Memory a view holds on its device (every tensor of it), as opposed to what a step reads."""
    tensors = [*view.pages.tensors().values(), view.sink_k, view.sink_v, view.block_table, view.tail_k, view.tail_v, view.tail_len, view.n_blocks]
    return sum(t.nbytes for t in tensors if t is not None)


def view_bytes(view: PagedView) -> int:
    """Bytes a decode step reads: every sealed block's data, sinks and tail."""
    n_tokens_blocks = view.block_table.numel()
    per_block = view.pages.fmt.block_bytes()
    ns = view.n_sink * view.block_table.shape[0]
    b = (n_tokens_blocks - ns) * sum(per_block.values())
    b += ns * 2 * view.sink_k[0].numel() * view.sink_k.element_size()
    b += 2 * view.tail_k.numel() * view.tail_k.element_size()
    return b


def _time(fn, copies: int, reps: int) -> float:
    """Median ms of one call, timing loops over all copies with CUDA events."""
    for i in range(min(copies, 3)):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(copies):
            fn(i)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / copies)
    ts.sort()
    return ts[len(ts) // 2]


def _time_graph(fn, copies: int, reps: int) -> float:
    """Like _time, but the calls on every copy are captured in one CUDA graph and replayed:
    the GPU's time per call, kernels and the gaps between them, without the host's launch
    overhead (what a captured decode step pays per layer). One graph for all copies rather
    than one per copy: a graph launch costs the host ~5-10 us, which at 4k would be timed
    instead of the kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    return _time(lambda _: g.replay(), 1, reps) / copies


def _copies(bytes_per_copy: int, target: int = 3 * 1024**3) -> int:
    return max(2, min(32, math.ceil(target / max(1, bytes_per_copy))))


# GPU memory a decode row keeps free beyond its copies: the kernels' split workspaces and
# outputs, a CUDA graph's pool, the allocator's rounding and fragments
_SLACK = 512 * 1024**2
# a copy this large is far beyond any GPU's L2 (the H200's is 60 MB): one copy times as well as two
_ONE_COPY = 512 * 1024**2


def _free_bytes(device) -> int:
    """GPU memory free for the next row: the driver's free bytes once the allocator has
    returned what it holds unused."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _fewest_copies(copy_bytes: int) -> int:
    """Two copies, so that no call finds its pages in L2 after the last; one of a copy far beyond it."""
    return 1 if copy_bytes >= _ONE_COPY else 2


def _fit_copies(copy_bytes: int, free: int, extra: int = 0) -> int:
    """How many copies of `copy_bytes` to time with `free` bytes, `extra` of them taken by a
    call's temporaries: `_copies`' count, fewer when they do not all fit, 0 when not even
    the fewest fit."""
    fit = (free - extra - _SLACK) // max(1, copy_bytes)
    return min(_copies(copy_bytes), fit) if fit >= _fewest_copies(copy_bytes) else 0


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _no_room(copy_bytes: int, free: int, extra: int = 0) -> str:
    """The note of a row whose fewest copies do not fit."""
    fewest = _fewest_copies(copy_bytes)
    parts = [f"{fewest} cop{'y' if fewest == 1 else 'ies'} of {_gib(copy_bytes)}"] + ([f"{_gib(extra)} of temporaries"] if extra else [])
    return f"out of GPU memory: needs {' + '.join(parts)} + {_gib(_SLACK)} of workspace, {_gib(free)} free"


def _out_of_memory(e: BaseException) -> bool:
    """An out-of-memory error, or an error raised while unwinding from one (a CUDA graph's
    capture that an allocation failed inside ends in an error of its own)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _timed_row(name: str, T: int, B: int, kv_bytes: int, measure) -> DecodeRow:
    """A row from `measure()` (its ms), or, when the GPU runs out of memory on the way, a row
    that says so and no time, the bench going on with the next."""
    try:
        return DecodeRow(name, T, B, measure(), kv_bytes)
    except Exception as e:
        if not _out_of_memory(e):
            raise
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=f"out of GPU memory ({type(e).__name__}: {str(e).splitlines()[0][:80]})")


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

    Each row times copies of its KV in distinct memory (see `_copies`), as many as fit in the
    GPU's free memory; a row that does not fit at all gets no time and a note saying what it
    needed, and the bench goes on with the next row."""
    import torch.nn.functional as F

    from .ops.gather_dequant import gather_dequant
    from .ops.paged_attention import paged_attention

    pairs = decode_cases(contexts, batches, cases)
    cfgs, Hq, H, D = _setup("decode", formats, block_size, shape)
    timer = _time_graph if graph else _time
    rows: list[DecodeRow] = []
    for T, B in pairs:
        q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.bfloat16)
        case: list[DecodeRow] = []
        dense_bytes = 2 * B * T * H * D * 2
        if peers:
            case.append(_sdpa_row(q, T, B, H, D, timer, reps))
            if not graph:
                case.append(_flex_row(q, B, T, H, D, block_size, reps))
        for name, cfg in cfgs.items():
            sized = synthetic_view(B, T, H, D, cfg, "meta")
            label, kv_bytes, copy_bytes = f"longctx {cfg.describe()}", view_bytes(sized), view_nbytes(sized)
            deq = "dequantize-all then SDPA (int4)" if peers and name == "int4" else None
            free = _free_bytes(device)
            L = _fit_copies(copy_bytes, free)
            if not L:
                case.append(DecodeRow(label, T, B, float("nan"), kv_bytes, note=_no_room(copy_bytes, free)))
                if deq:
                    case.append(DecodeRow(deq, T, B, float("nan"), kv_bytes, note=_no_room(copy_bytes, free, dense_bytes)))
                continue
            views: list[PagedView] = []

            def attend():
                views.append(synthetic_view(B, T, H, D, cfg, device))
                views.extend(copy_view(views[0]) for _ in range(1, L))
                return timer(lambda i: paged_attention(q, views[i], backend="triton", return_lse=False), L, reps)

            case.append(_timed_row(label, T, B, kv_bytes, attend))
            if deq and len(views) == L:
                # the same copies, as many as leave room for one call's dense K and V
                n = min(L, _fit_copies(copy_bytes, free, dense_bytes))
                del views[n:]
                if not n:
                    case.append(DecodeRow(deq, T, B, float("nan"), kv_bytes, note=_no_room(copy_bytes, free, dense_bytes)))
                else:
                    def deq_all(i):
                        k, v = gather_dequant(views[i], out_dtype=torch.bfloat16)
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                    case.append(_timed_row(deq, T, B, kv_bytes, lambda: timer(deq_all, n, max(3, reps // 4))))
            elif deq:
                case.append(DecodeRow(deq, T, B, float("nan"), kv_bytes, note=case[-1].note))
            del views
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

    name, dense_bytes = "SDPA dense bf16", 2 * B * T * H * D * 2
    L = _fit_copies(dense_bytes, free := _free_bytes(q.device))
    if not L:
        return DecodeRow(name, T, B, float("nan"), dense_bytes, note=_no_room(dense_bytes, free))
    kvs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def measure():
        kvs.extend((torch.randn(B, H, T, D, device=q.device, dtype=torch.bfloat16), torch.randn(B, H, T, D, device=q.device, dtype=torch.bfloat16))
                   for _ in range(L))
        return timer(lambda i: F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], enable_gqa=True), L, reps)

    try:
        return _timed_row(name, T, B, dense_bytes, measure)
    finally:
        del kvs
        torch.cuda.empty_cache()


@dataclass
class PrefillRow:
    name: str
    context: int  # tokens in the cache after the chunk
    chunk: int
    ms: float  # one layer: seal the chunk's blocks (longctx) + attention of the chunk
    ratio_to_sdpa: float = float("nan")

    @property
    def tok_per_s(self) -> float:
        return self.chunk / (self.ms / 1e3)

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_per_s": self.tok_per_s}


def _flex_row(q, B: int, T: int, H: int, D: int, block_size: int, reps: int) -> DecodeRow:
    """The FlexAttention paged bf16 peer (backend "flex" over 16-bit pages). A failure to
    compile or run is reported in the row's note (time nan), not raised."""
    from .ops.paged_attention import paged_attention

    name, cfg = "FlexAttention paged bf16", KVConfig(bits=16, block_size=block_size)
    sized = synthetic_view(B, T, H, D, cfg, "meta")
    kv_bytes, copy_bytes = view_bytes(sized), view_nbytes(sized)
    L = _fit_copies(copy_bytes, free := _free_bytes(q.device))
    if not L:
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=_no_room(copy_bytes, free))
    views: list[PagedView] = []

    def measure():
        views.append(synthetic_view(B, T, H, D, cfg, q.device))
        views.extend(copy_view(views[0]) for _ in range(1, L))
        return _time(lambda i: paged_attention(q, views[i], backend="flex", return_lse=False), L, reps)

    try:
        return _timed_row(name, T, B, kv_bytes, measure)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is a finding, shown in the table
        return DecodeRow(name, T, B, float("nan"), kv_bytes, note=f"failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
    finally:
        del views
        torch.cuda.empty_cache()


def _config(name: str, block_size: int) -> KVConfig:
    return kv_preset(_ALIASES.get(name, name), block_size=block_size)


def bench_configs(formats, block_size: int = 64, shape: str = "llama-3-8b") -> tuple[dict[str, KVConfig], dict[str, int]]:
    """The formats' configs by name and the shape's dimensions, checked (bad names fail here,
    before anything is built): what a bench runs with, and what `--print-config` shows."""
    cfgs = {name: _config(name, block_size) for name in formats}
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return cfgs, SHAPES[shape]


def _setup(bench: str, formats, block_size: int, shape: str = "llama-3-8b") -> tuple[dict[str, KVConfig], int, int, int]:
    """Every bench's start: the formats' configs, a CUDA check, and the shape's (query heads,
    KV heads, head_dim)."""
    cfgs, dims = bench_configs(formats, block_size, shape)
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"bench {bench} needs a CUDA GPU; this machine has none")
    return cfgs, dims["heads"], dims["kv_heads"], dims["head_dim"]


def bench_prefill(contexts=(32768, 131072), chunks=(16384,), formats=("int4", "int8"), shape: str = "llama-3-8b", block_size: int = 64,
                  reps: int = 5, device: str = "cuda", progress=None, paths=("kernel", "staged")) -> list[PrefillRow]:
    """Per-layer time of the last prefill chunk of a `context`-token prompt, for each chunk
    length: longctx appends the chunk, attends over the pages and seals the chunk's blocks, by
    each prefill path (the kernel over the pages; staging the past densely, then SDPA's flash
    kernel); the peer is SDPA (flash, lower-right causal) over dense bf16 K/V, as
    DynamicCache + SDPA prefill runs."""
    from .cache import PagedKVCache
    from .ops.paged_attention import triton as kernels
    from .ops.paged_attention.prefill import sdpa_lower_right

    for path in paths:
        if path not in ("kernel", "staged"):
            raise ValueError(f"prefill paths are 'kernel' and 'staged', got {path!r}")
    if any(c < 2 for c in chunks):  # chunks longer than a context are cut to it
        raise ValueError(f"prefill chunks must be at least 2 tokens (one token is a decode step), got {list(chunks)}")
    cfgs, Hq, H, D = _setup("prefill", formats, block_size, shape)
    rows: list[PrefillRow] = []
    for T in contexts:
        g = torch.Generator(device=device).manual_seed(T)
        k = torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
        for C in sorted({min(c, T) for c in chunks}):
            q = torch.randn(1, Hq, C, D, device=device, dtype=torch.bfloat16, generator=g)
            case = [PrefillRow("SDPA dense bf16 (flash)", T, C, _time(lambda _, q=q: sdpa_lower_right(q, k, v), 1, reps))]
            for name, cfg in cfgs.items():
                cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=H, head_dim=D)
                cache.append(0, k[:, :, : T - C], v[:, :, : T - C])
                cache.seal()
                for path in paths:
                    case.append(PrefillRow(f"longctx {cfg.describe()} ({path})", T, C, _time_chunk(cache, kernels, path, q, k, v, T, C, reps)))
                cache.reset()
                del cache
                torch.cuda.empty_cache()
            for r in case:
                r.ratio_to_sdpa = case[0].ms / r.ms
            rows.extend(case)
            if progress is not None:
                progress(case)
            del q
        del k, v
        torch.cuda.empty_cache()
    return rows


def _time_chunk(cache, kernels, path: str, q, k, v, T: int, C: int, reps: int) -> float:
    """Median ms of (append the chunk, attend by `path`, seal) on a cache holding T - C tokens."""
    saved = kernels.TUNE["prefill"]
    kernels.TUNE["prefill"] = path
    try:
        ts = []
        for i in range(reps + 1):  # the first compiles
            cache.crop(T - C)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            cache.append(0, k[:, :, T - C :], v[:, :, T - C :])
            cache.attend(0, q, start=None, return_lse=False)
            cache.seal()
            e.record()
            torch.cuda.synchronize()
            if i:
                ts.append(s.elapsed_time(e))
    finally:
        kernels.TUNE["prefill"] = saved
    ts.sort()
    return ts[len(ts) // 2]


@dataclass
class SealRow:
    name: str
    context: int
    layers: int  # layers a step appends to and attends in
    block_size: int  # steps between two seals
    attend_ms: float  # attention alone in every layer, median step
    step_ms: float  # append one token + attend in every layer: the median step that seals nothing
    sealing_step_ms: float  # the steps that seal (every layer's full tail), mean

    @property
    def overhead_pct(self) -> float:
        """What sealing adds to the average decode step: the sealing step's excess over the
        median step, spread over the block_size steps between seals (`sealing_share`)."""
        return (self.sealing_step_ms / self.step_ms - 1) * 100 / self.block_size

    @property
    def append_pct(self) -> float:
        """What appending the token adds to attention alone (no sealing)."""
        return (self.step_ms / self.attend_ms - 1) * 100

    def as_dict(self) -> dict:
        return {**asdict(self), "overhead_pct": self.overhead_pct, "append_pct": self.append_pct}


def bench_seal(context: int = 131072, formats=("int4",), shape: str = "llama-3-8b", block_size: int = 64, device: str = "cuda",
               rounds: int = 4, layers: int | None = None) -> list[SealRow]:
    """What sealing adds to decode, through a real PagedKVCache at `context` tokens. A step
    appends one token and attends in each of `layers` layers (default: the shape's), as a
    model's decode step does; its first append seals every layer's full tail, as in a model,
    so a seal's host work (one finiteness check and its sync, the index lists) is paid once a
    step and its quantize launch once a layer. `rounds` x block_size steps run back to back
    (no sync between them, so host and GPU overlap as in decoding), each step timed on the
    GPU timeline; the steps that sealed are compared with the median step that did not, as
    `bench e2e` does for a whole model (`sealing_share`). The model's other work
    (projections, MLP) is left out, so the share is an upper bound of what sealing adds to a
    model's step."""
    from .cache import PagedKVCache

    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    cfgs, Hq, H, D = _setup("seal", formats, block_size, shape)
    L = SHAPES[shape]["layers"] if layers is None else layers
    P = block_size
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, cfg in cfgs.items():
        cache = PagedKVCache(cfg, num_layers=L, num_kv_heads=H, head_dim=D)
        for t0 in range(0, context, 16384):  # every layer gets the same tokens: speed does not depend on them
            n = min(16384, context - t0)
            k = torch.randn(1, H, n, D, device=device, dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, H, n, D, device=device, dtype=torch.bfloat16, generator=g)
            for layer in range(L):
                cache.append(layer, k, v)
            cache.seal()
        del k, v
        q = torch.randn(1, Hq, 1, D, device=device, dtype=torch.bfloat16, generator=g)
        new = torch.randn(P, 2, 1, H, 1, D, device=device, dtype=torch.bfloat16, generator=g)

        def run(steps: int, append: bool = True) -> tuple[list[float], list[bool]]:
            """Each step's GPU time in ms, and whether it sealed."""
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            sealed = []
            torch.cuda.synchronize()
            marks[0].record()
            for i in range(steps):
                before = cache.seals
                for layer in range(L):
                    if append:
                        cache.append(layer, new[i % P, 0], new[i % P, 1])
                    cache.attend(layer, q, return_lse=False)
                marks[i + 1].record()
                sealed.append(cache.seals != before)
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])], sealed

        run(2 * P)  # warm-up: the first seals compile their kernel specialization
        times, sealed = run(rounds * P)  # rounds seals: one every P steps
        extra, _ = sealing_share(times, sealed, P)
        step = _median([t for t, s in zip(times, sealed) if not s])
        rows.append(SealRow(f"longctx {cfg.describe()}", context, L, P, _median(run(P, append=False)[0]), step, step + extra))
        cache.reset()
        del cache
        torch.cuda.empty_cache()
    return rows


@dataclass
class E2ERow:
    name: str
    context: int
    prefill_s: float
    decode_ms_per_token: float
    peak_gib: float
    ratio_decode: float = float("nan")  # DynamicCache ms/token / this (>1: faster)
    ratio_prefill: float = float("nan")  # this prefill time / DynamicCache's (<1: faster)
    seal_extra_ms: float = float("nan")  # a sealing step's time over the median step's (LongCtxCache)
    seal_pct: float = float("nan")  # that excess spread over block_size steps, % of the median step
    compile_s: float = float("nan")  # the compiled peer: its warm-up steps (compiling and recording), s
    recorded: int = 0  # the CUDA-graph row: graphs recorded, its warm-up steps' first one included
    note: str = ""  # why a row has no figures (nan): the GPU ran out of memory, and where

    def as_dict(self) -> dict:
        return asdict(self)


def _median(xs: list[float]) -> float:
    s, n = sorted(xs), len(xs)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def sealing_share(step_ms: list[float], sealed: list[bool], block_size: int) -> tuple[float, float]:
    """What sealing adds to decoding, from per-step times of a whole model: (the sealing
    steps' mean excess over the median step that sealed nothing, in ms; that excess spread
    over the block_size steps between two seals, in % of the median step). (nan, nan) when
    no step sealed or every step did."""
    plain = [t for t, s in zip(step_ms, sealed, strict=True) if not s]
    seals = [t for t, s in zip(step_ms, sealed, strict=True) if s]
    if not plain or not seals:
        return float("nan"), float("nan")
    median = _median(plain)
    extra = sum(seals) / len(seals) - median
    return extra, 100.0 * extra / (block_size * median)


def llama3_8b_shaped(layers: int = 32, max_positions: int = 1 << 20, device: str = "cuda"):
    """A random-initialized model with Llama-3-8B's shapes, bf16 weights, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, max_position_embeddings=max_positions, rope_theta=500000.0, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


STATIC_WARMUP = 3  # compiled steps before timing: cudagraph trees run, record, then replay


def bench_e2e(context: int = 131072, formats=("int4", "int8"), new_tokens: int = 64, chunk: int = 16384, layers: int = 32,
              device: str = "cuda", progress=None, warmup: int = 2, graphs: bool = True, compiled: bool = True) -> list[E2ERow]:
    """Prefill `context` random tokens in chunks, then decode `new_tokens` greedily, with
    transformers' DynamicCache + SDPA and with LongCtxCache in each format, same model.
    LongCtxCache's prefill time includes sealing the prompt's last chunk (which would
    otherwise land in the first decode step). Each cache's timed prefill follows an untimed one
    of up to two chunks into a throwaway cache of its kind (`warm`: kernels compile on their
    first call in a process, which a user pays once, not per prompt). The first `warmup` decode steps are not timed
    (they compile the decode kernels: ~1 s once per process, not per token); the default 64
    timed tokens include one seal of every layer's tail, as steady decoding does every 64:
    each timed step is timed on the GPU's timeline (events, no sync), and for LongCtxCache
    `sealing_share` gives what the sealing step adds (`seal_extra_ms`, `seal_pct`).

    graphs: after each LongCtxCache's eager steps, `new_tokens` more from CUDA graphs
    (`GraphDecoder`, the same cache, `warmup` untimed steps first), a row of its own ("+ CUDA
    graphs"; its prefill is the same cache's). Their time includes what a block's seal costs
    (one graph serves across seals) and any new recording (when the graph table fills or the
    pools grow); their sealing share counts a step that records as sealing.

    compiled: also transformers' `StaticCache` with the decode step under
    `torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs), the strongest stock
    decode: prefill eager into the static cache, then `STATIC_WARMUP` untimed steps that
    compile and record (`compile_s`), then `new_tokens` timed. Where compiling fails the row is
    left out with a warning naming the error.

    A cache that runs the GPU out of memory (DynamicCache's 16 GiB of K/V at 128k on a 24 GB
    card) gets a row with no figures and a note of where it stopped, and the bench goes on
    with the next cache."""
    import gc
    import time

    from transformers import DynamicCache

    from .integrations.transformers import LongCtxCache, cache_kwarg_name, cache_kwargs

    cfgs, _, _, _ = _setup("e2e", formats, 64)  # bad names fail before a 16 GB model is built
    model = llama3_8b_shaped(layers, context + 2 * (warmup + new_tokens) + 16, device)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).to(device)

    rows: list[E2ERow] = []
    now = {"row": "", "stage": ""}  # the row being measured and where, for an out-of-memory note

    def guarded(measure, *args) -> None:
        """`measure(*args)`, which appends its rows; when the GPU runs out of memory on the way,
        the row it was measuring gets no figures and a note instead."""
        try:
            measure(*args)
        except Exception as e:
            if not _out_of_memory(e):
                raise
            nan = float("nan")
            rows.append(E2ERow(now["row"], context, nan, nan, torch.cuda.max_memory_allocated() / 2**30,
                               note=f"out of GPU memory in {now['stage']}"))
            if progress is not None:
                progress(rows[-1])
        gc.collect()  # (what the failed row held, before the next one allocates)
        torch.cuda.empty_cache()

    def decode(cache, tok, steps: int, marks: list | None = None, decoder=None):
        """`steps` greedy tokens, eager or from `decoder` (a GraphDecoder over `cache`); with
        `marks`, appends (an event recorded at the step's start, whether the step sealed or
        recorded a graph) per step and one end event (sealed None)."""
        paged = getattr(cache, "paged", None)
        for _ in range(steps):
            before = (paged.seals if paged is not None else 0, decoder.recorded if decoder is not None else 0)
            if marks is not None:
                marks.append([torch.cuda.Event(enable_timing=True), False])
                marks[-1][0].record()
            if decoder is not None:
                decoder.step(tok)
                tok = decoder.next_ids
            else:
                tok = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            if marks is not None:
                marks[-1][1] = paged is not None and (paged.seals, decoder.recorded if decoder is not None else 0) != before
        if marks is not None:
            marks.append([torch.cuda.Event(enable_timing=True), None])
            marks[-1][0].record()
        return tok

    def timed(name, cache, tok, prefill_s: float, decoder=None):
        """`warmup` untimed steps, then `new_tokens` timed ones: (the row, the last token)."""
        now["stage"] = "decode" if decoder is None else "decode from CUDA graphs"
        tok = decode(cache, tok, warmup, decoder=decoder)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        marks: list = []
        tok = decode(cache, tok, new_tokens, marks, decoder)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        row = E2ERow(name, context, prefill_s, (t2 - t1) / new_tokens * 1e3, torch.cuda.max_memory_allocated() / 2**30)
        if isinstance(cache, LongCtxCache):
            step_ms = [a[0].elapsed_time(b[0]) for a, b in zip(marks, marks[1:])]
            row.seal_extra_ms, row.seal_pct = sealing_share(step_ms, [m[1] for m in marks[:-1]], cache.paged.block_size)
        if progress is not None:
            progress(row)
        return row, tok

    def warm(make) -> None:
        """An untimed prefill of up to two chunks into a throwaway cache from `make`, so that the
        timed prefill does not include compiling kernels (Triton's, on their first call in a
        process: seconds at short contexts) or first-use setup."""
        now["stage"] = "the untimed prefill"
        with torch.inference_mode():
            cache = make()
            for s in range(0, min(context, 2 * chunk), chunk):
                model(input_ids=ids[:, s : s + chunk], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
            if isinstance(cache, LongCtxCache):
                cache.paged.seal()
                cache.detach()
        del cache
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def run(name, make) -> None:
        """The rows of a cache from `make`: prefill and eager decode, and for LongCtxCache decode
        from CUDA graphs (`graphs`); a warm-up prefill first (`warm`)."""
        now["row"] = name
        torch.cuda.reset_peak_memory_stats()
        warm(make)
        cache = make()
        try:
            prefill_and_decode(name, cache)
        finally:
            if isinstance(cache, LongCtxCache):
                cache.detach()

    def prefill_and_decode(name, cache) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, context, chunk):
                now["stage"] = f"prefill, at token {s:,} of {context:,}"
                out = model(input_ids=ids[:, s : s + chunk], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
            tok = out.logits[:, -1:].argmax(-1)
            if isinstance(cache, LongCtxCache):  # seal the prompt's last chunk here, not in the first decode step
                cache.paged.seal()
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            row, tok = timed(name, cache, tok, prefill_s)
        rows.append(row)
        if not (graphs and isinstance(cache, LongCtxCache)):
            return
        from .graphs import GraphDecoder

        now["row"] = f"{name} + CUDA graphs"
        with torch.inference_mode():
            decoder = GraphDecoder(model, cache)
            graphed, tok = timed(now["row"], cache, tok, prefill_s, decoder)
        graphed.recorded = decoder.recorded
        rows.append(graphed)

    def run_static() -> None:
        from transformers import StaticCache

        now["row"], now["stage"] = "StaticCache + torch.compile (CUDA graphs)", "allocating the static cache"
        cache = StaticCache(config=model.config, max_cache_len=context + STATIC_WARMUP + new_tokens + 1)
        kw = cache_kwargs(model, cache)
        key = cache_kwarg_name(model)  # (named outside the compiled step)

        def step(tok, pos, cache):
            out = model(input_ids=tok, cache_position=pos, use_cache=True, **{key: cache})
            return out.logits[:, -1:].argmax(-1)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        # no_grad, not inference_mode: the compiled step's CUDA graphs take the cache's tensors as
        # ordinary inputs, and tensors made in inference mode cannot be
        with torch.no_grad():
            for s in range(0, context, chunk):
                now["stage"] = f"prefill, at token {s:,} of {context:,}"
                e = min(context, s + chunk)
                out = model(input_ids=ids[:, s:e], cache_position=torch.arange(s, e, device=device), use_cache=True, logits_to_keep=1, **kw)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            compiled_step = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            now["stage"] = "compiling and recording the decode step"
            pos = context
            t1 = time.perf_counter()
            for _ in range(STATIC_WARMUP):
                tok = compiled_step(tok, torch.tensor([pos], device=device), cache).clone()  # (a replay overwrites its output)
                pos += 1
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            now["stage"] = "decode"
            for _ in range(new_tokens):
                tok = compiled_step(tok, torch.tensor([pos], device=device), cache).clone()
                pos += 1
            torch.cuda.synchronize()
            t3 = time.perf_counter()
        row = E2ERow(now["row"], context, prefill_s, (t3 - t2) / new_tokens * 1e3, torch.cuda.max_memory_allocated() / 2**30, compile_s=t2 - t1)
        rows.append(row)
        if progress is not None:
            progress(row)

    guarded(run, "DynamicCache + SDPA", lambda: DynamicCache(config=model.config))
    if compiled:
        try:
            guarded(run_static)
        except Exception as e:  # (a compiler missing or failing must not cost the other rows)
            warnings.warn(f"bench e2e: StaticCache + torch.compile left out: {type(e).__name__}: {e}", stacklevel=2)
        torch._dynamo.reset()  # frees the compiled step's CUDA graphs and their memory pool
        torch.cuda.empty_cache()
    for cfg in cfgs.values():
        guarded(run, f"LongCtxCache {cfg.describe()}", lambda cfg=cfg: LongCtxCache(model, cfg))
    for r in rows:
        r.ratio_decode = rows[0].decode_ms_per_token / r.decode_ms_per_token
        r.ratio_prefill = r.prefill_s / rows[0].prefill_s
    return rows
