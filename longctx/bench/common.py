"""What every bench shares: the model shapes and named formats they take, synthetic paged
views and their copies in distinct memory, the GPU timers, and how many copies fit in the
GPU's free memory (a row that does not fit says so instead of stopping the bench)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..config import KVConfig, kv_preset
from ..errors import BackendUnavailableError
from ..ops.pages import Pages, PagedView

LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128, layers=32)
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64, layers=30)
SHAPES = {"llama-3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2}
# the benches take the named KV formats (longctx/configs/kv.yaml) at their block size; "int2"
# is int2+rot (2-bit pages are rotated), the name they took before the formats were shared
_ALIASES = {"int2": "int2+rot"}


def synthetic_view(batch: int, context: int, kv_heads: int, head_dim: int, cfg: KVConfig, device, dtype=torch.bfloat16, seed: int = 0) -> PagedView:
    """A paged batch of `context` tokens per row with random codes and scales: one sink
    block, sealed blocks at shuffled pool slots, and a half-full tail. On the "meta" device,
    the same tensors without values: what a view of that size takes (`view_nbytes`)."""
    cfg = cfg.resolve(1, head_dim)
    P, H, D = cfg.block_size, kv_heads, head_dim
    g = torch.Generator(device="cpu").manual_seed(seed)
    tail = P // 2
    n_blocks = max(1, (context - tail) // P)
    fmt = cfg.block_format(0, D, H, dtype)
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
        pages.k_scale, pages.k_zero = rnd(n, H, fmt.k_groups, D).abs() * 0.1, rnd(n, H, fmt.k_groups, D)
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


def copy_view(view: PagedView, device=None) -> PagedView:
    """`view` in fresh memory, on `device` (default: its own). The timed copies of a view are
    there to defeat the L2 cache by their addresses, not their values: cloning one on the
    device spares drawing each on the host (~3 GB a format and case, seconds each)."""

    def copy(t):
        return None if t is None else t.to(t.device if device is None else device, copy=True)

    pages = Pages(view.pages.fmt, **{name: copy(t) for name, t in view.pages.tensors().items()})
    return replace(view, pages=pages, sink_k=copy(view.sink_k), sink_v=copy(view.sink_v), block_table=copy(view.block_table),
                   tail_k=copy(view.tail_k), tail_v=copy(view.tail_v), tail_len=copy(view.tail_len), n_blocks=copy(view.n_blocks))


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


def time_calls(fn, copies: int, reps: int) -> float:
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


def time_graph(fn, copies: int, reps: int) -> float:
    """Like time_calls, but the calls on every copy are captured in one CUDA graph and replayed:
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
    return time_calls(lambda _: g.replay(), 1, reps) / copies


def copies_for(bytes_per_copy: int, target: int = 3 * 1024**3) -> int:
    return max(2, min(32, math.ceil(target / max(1, bytes_per_copy))))


# GPU memory a decode row keeps free beyond its copies: the kernels' split workspaces and
# outputs, a CUDA graph's pool, the allocator's rounding and fragments
SLACK = 512 * 1024**2
# a copy this large is far beyond any GPU's L2 (the H200's is 60 MB): one copy times as well as two
_ONE_COPY = 512 * 1024**2


def free_bytes(device) -> int:
    """GPU memory free for the next row: the driver's free bytes once the allocator has
    returned what it holds unused."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _fewest_copies(copy_bytes: int) -> int:
    """Two copies, so that no call finds its pages in L2 after the last; one of a copy far beyond it."""
    return 1 if copy_bytes >= _ONE_COPY else 2


def fit_copies(copy_bytes: int, free: int, extra: int = 0) -> int:
    """How many copies of `copy_bytes` to time with `free` bytes, `extra` of them taken by a
    call's temporaries: `copies_for`' count, fewer when they do not all fit, 0 when not even
    the fewest fit."""
    fit = (free - extra - SLACK) // max(1, copy_bytes)
    return min(copies_for(copy_bytes), fit) if fit >= _fewest_copies(copy_bytes) else 0


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def no_room(copy_bytes: int, free: int, extra: int = 0) -> str:
    """The note of a row whose fewest copies do not fit."""
    fewest = _fewest_copies(copy_bytes)
    parts = [f"{fewest} cop{'y' if fewest == 1 else 'ies'} of {_gib(copy_bytes)}"] + ([f"{_gib(extra)} of temporaries"] if extra else [])
    return f"out of GPU memory: needs {' + '.join(parts)} + {_gib(SLACK)} of workspace, {_gib(free)} free"


def out_of_memory(e: BaseException) -> bool:
    """An out-of-memory error, or an error raised while unwinding from one (a CUDA graph's
    capture that an allocation failed inside ends in an error of its own)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def format_config(name: str, block_size: int) -> KVConfig:
    return kv_preset(_ALIASES.get(name, name), block_size=block_size)


def bench_configs(formats, block_size: int = 64, shape: str = "llama-3-8b") -> tuple[dict[str, KVConfig], dict[str, int]]:
    """The formats' configs by name and the shape's dimensions, checked (bad names fail here,
    before anything is built): what a bench runs with, and what `--print-config` shows."""
    cfgs = {name: format_config(name, block_size) for name in formats}
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return cfgs, SHAPES[shape]


def bench_setup(bench: str, formats, block_size: int, shape: str = "llama-3-8b") -> tuple[dict[str, KVConfig], int, int, int]:
    """Every bench's start: the formats' configs, a CUDA check, and the shape's (query heads,
    KV heads, head_dim)."""
    cfgs, dims = bench_configs(formats, block_size, shape)
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"bench {bench} needs a CUDA GPU; this machine has none")
    return cfgs, dims["heads"], dims["kv_heads"], dims["head_dim"]


def median_of(xs: list[float]) -> float:
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
    median = median_of(plain)
    extra = sum(seals) / len(seals) - median
    return extra, 100.0 * extra / (block_size * median)


def greedy_steps(model, cache, first: torch.Tensor, n: int):
    """Yield `n` greedy token ids decoded eagerly through `cache`, the first being `first` (int
    [1, 1]), which is fed to get the next (call under torch.inference_mode)."""
    from ..integrations.transformers import cache_kwargs

    tok = first
    for _ in range(n):
        yield int(tok)
        tok = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
