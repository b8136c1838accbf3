"""`bench offload`: decode steps of an 8B-shaped model whose cache outgrows the GPU, the host
tier against the same cache all on the GPU, transformers' offloaded cache and the PCIe floor.

A random-initialized model of a catalog model's shape (bf16 weights or bitsandbytes NF4,
`bench plan`'s stand-in), the process capped at a budget with
`torch.cuda.set_per_process_memory_fraction`. The caches are filled directly: random keys and
values appended to every layer (sealed, and spilled to the host tier, as a prefill's would be;
no forward, so a million tokens fill in a call), then `steps` greedy decode steps run through
the model, timed after two untimed ones. Rows per context:
- LongCtxCache in each format with a host tier: the device pool and host tier `longctx plan
  --host-mem` gives for the budget (the device pool full, the rest on the host);
- the same format with no budget, all on the GPU, where the card holds it;
- transformers' `DynamicCache(offloading=True)` (bf16, layer by layer to CPU memory) at the
  peer contexts, where it runs;
- the PCIe floor: the host tier's bytes per step over the pinned host-to-device bandwidth
  measured in the same run.

`bench_offload_prefill` measures the other side: a real prefill (the model's forward over
random token ids, in chunks) past the budget, spilling as it seals, against the same prefill
with no budget, and the greedy tokens after each.
"""

from __future__ import annotations

import gc
import importlib
import time
from dataclasses import asdict, dataclass

import torch

from ..config import bits_format
from ..errors import BackendUnavailableError
from ..plan import model_shape, offload_step_ms, plan
from .common import greedy_steps, out_of_memory
from .plan import FORMATS, random_model, to_nf4

GIB = 2**30
FILL_CHUNK = 4096  # tokens a row appended at a time while filling (plan's chunk for the device pool)


@dataclass
class OffloadRow:
    name: str
    context: int
    step_ms: float  # a decode step of the whole model (nan: did not run)
    host_gib: float = 0.0  # bytes the step reads from host memory
    floor_ms: float = float("nan")  # host bytes / pinned H2D bandwidth (the host-tier rows and the floor row)
    over_floor: float = float("nan")  # step / floor
    speedup: float = float("nan")  # transformers' offloaded cache's step / this, at the same context
    peak_gib: float = float("nan")  # torch.cuda.max_memory_allocated() over the fill and the steps
    fill_s: float = float("nan")
    cpu_ms: float = float("nan")  # the host part's attention computed on the CPU instead, one step (all layers, extrapolated from one)
    plan_ms: float = float("nan")  # the step `plan` predicts at this context, given the H2D bandwidth measured here
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def host_part_on_cpu_ms(paged, heads: int) -> float:
    """One decode step's attention over the host pages computed on the CPU where they lie
    (the reference backend, a slice at a time, as the staging would cut them): the first two
    slices of one layer timed, scaled to all host columns and layers."""
    from ..ops.paged_attention import paged_attention
    from ..ops.pages import PagedView

    host, t = paged.host, paged.tables
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # (the spills' copies into the host pools have landed)
    pages = host.pages[0]
    B, H, D = paged.batch_size, paged.num_kv_heads, paged.head_dim
    q = torch.randn(B, heads, 1, D, dtype=paged.dtype)
    empty = torch.empty(B, H, 0, D, dtype=paged.dtype)
    sinks = torch.empty(0, H, paged.block_size, D, dtype=paged.dtype)
    step = host.stage_blocks // max(1, B)
    end = min(t.host_upto, t.sink_blocks + 2 * step)
    t0 = time.perf_counter()
    for c0 in range(t.sink_blocks, end, step):
        table = torch.tensor([row[c0 : min(c0 + step, end)] for row in t.rows], dtype=torch.int32)
        view = PagedView(pages=pages, sink_k=sinks, sink_v=sinks, block_table=table, n_sink=0, tail_k=empty, tail_v=empty)
        paged_attention(q, view, backend="reference")
    return (time.perf_counter() - t0) * 1e3 * t.host_columns / (end - t.sink_blocks) * paged.num_layers


def release_pinned() -> None:
    """Give torch's cached pinned host blocks back (their names differ across torch versions)."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def h2d_gbps(device, nbytes: int = GIB, reps: int = 5) -> float:
    """The best of `reps` pinned host -> device copies of `nbytes`, GB/s (10^9 bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def check_offload_options(formats, contexts, peer_contexts, weights_bits: int, budget_gib: float, steps: int) -> None:
    """Bad values, refused before a model or a GPU is needed."""
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"bench offload: unknown format {f!r}; use {', '.join(FORMATS)}")
    for what, values in (("contexts", contexts), ("peer contexts", peer_contexts)):
        if any(c < FILL_CHUNK for c in values):
            raise ValueError(f"bench offload: {what} must be at least {FILL_CHUNK:,} tokens, got {list(values)}")
    if weights_bits not in (16, 4):
        raise ValueError(f"bench offload: weights bits must be 16 (bf16) or 4 (bitsandbytes NF4), got {weights_bits}")
    if budget_gib <= 0:
        raise ValueError(f"bench offload: the budget must be more than 0 GiB, got {budget_gib}")
    if steps < 1:
        raise ValueError(f"bench offload: steps must be at least 1, got {steps}")


def bench_offload(model: str = "llama-3.1-8b", contexts=(262144, 524288, 1048576), formats=("int4", "int2+rot"), weights_bits: int = 4,
                  budget_gib: float = 24.0, peer_contexts=(131072, 262144), steps: int = 8, full_gpu: bool = True, progress=None) -> list[OffloadRow]:
    """The rows of the module's docstring; progress(row) as each is measured."""
    from transformers import DynamicCache

    from ..integrations.transformers import LongCtxCache, cache_kwargs
    from ..offload import host_memory_available

    check_offload_options(formats, contexts, peer_contexts, weights_bits, budget_gib, steps)
    if not torch.cuda.is_available():
        raise BackendUnavailableError("bench offload needs a CUDA GPU; this machine has none")
    if weights_bits == 4:  # (refused in one line before a model is built where it is missing)
        importlib.import_module("bitsandbytes")
    shape = model_shape(model)
    total = torch.cuda.get_device_properties(0).total_memory
    if budget_gib * GIB > total:
        raise ValueError(f"bench offload: a budget of {budget_gib:.1f} GiB is more than this GPU's {total / GIB:.1f} GiB")
    net = random_model(shape, max(contexts) + steps + 16)
    if weights_bits == 4:
        to_nf4(net)
    device = net.device
    gbps = h2d_gbps(device)
    rows: list[OffloadRow] = []
    measure_cpu = [True]  # the host part on the CPU: measured at the first host-tier row

    def emit(row: OffloadRow) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    def decode(cache, context: int) -> float:
        """Two untimed greedy steps, then `steps` timed: ms a step."""
        tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.inference_mode():
            for i in range(2 + steps):
                if i == 2:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                pos = torch.tensor([[context + i]], device=device)
                tok = net(input_ids=tok, position_ids=pos, use_cache=True, **cache_kwargs(net, cache)).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e3

    def fill(cache_append, context: int) -> float:
        """Append `context` random tokens to every layer in chunks: seconds."""
        g = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(1, shape.kv_heads, FILL_CHUNK, shape.head_dim, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(k.shape, generator=g, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - s)
            for layer in range(shape.layers):
                cache_append(layer, k[:, :, :n], v[:, :, :n])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def measured(name: str, context: int, run) -> None:
        """A row from run() -> OffloadRow, or a row with the reason it has no figures."""
        torch.cuda.reset_peak_memory_stats()
        try:
            row = run()
            row.peak_gib = torch.cuda.max_memory_allocated() / GIB
        except Exception as e:
            if not out_of_memory(e):
                raise
            row = OffloadRow(name, context, float("nan"), note="out of GPU memory")
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        emit(row)
        if row.floor_ms == row.floor_ms and row.host_gib:
            emit(OffloadRow(f"PCIe floor: {row.host_gib:.2f} GiB a step at {gbps:.1f} GB/s pinned H2D", context, row.floor_ms, row.host_gib,
                            row.floor_ms, 1.0))

    def ours(fmt: str, context: int, budget: bool) -> OffloadRow:
        bits = FORMATS[fmt]
        name = f"LongCtxCache {fmt}" + (f" + host tier, {budget_gib:g} GiB budget" if budget else ", all on the GPU")
        cfg = bits_format(bits)
        predicted = float("nan")
        if budget:
            free_host = host_memory_available()
            p = plan(shape, "budget", budget_gib, weights_bits=weights_bits, kv_bits=(bits,), prefill_chunk=FILL_CHUNK,
                     host_gib=free_host * 0.8 / GIB).rows[0]
            blocks = -(-context // cfg.block_size) + 8  # (the steps' tokens, a spill's headroom)
            if p.max_tokens_offload is None or p.offload_max_blocks + p.host_blocks < blocks:
                return OffloadRow(name, context, float("nan"), note=f"does not fit {budget_gib:g} GiB and this machine's host memory")
            cfg = bits_format(bits, max_blocks=p.offload_max_blocks, host_blocks=max(1, blocks - p.offload_max_blocks))
            predicted = offload_step_ms(shape, cfg, context, p.offload_max_blocks, gbps)
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * GIB / total))
        cache = LongCtxCache(net, cfg)
        try:
            fill_s = fill(cache.paged.append, context)
            cache.paged.seal()
            step = decode(cache, context)
            host = cache.paged.memory_report().bytes_by_tier["host"]
            cpu_ms = float("nan")
            if host and measure_cpu[0]:  # (once a run, at the first row with host pages)
                cpu_ms, measure_cpu[0] = host_part_on_cpu_ms(cache.paged, shape.heads), False
        finally:
            cache.detach()
            torch.cuda.set_per_process_memory_fraction(1.0)
        floor = host / (gbps * 1e9) * 1e3
        return OffloadRow(name, context, step, host / GIB, floor if host else float("nan"), step / floor if host else float("nan"),
                          fill_s=fill_s, cpu_ms=cpu_ms, plan_ms=predicted, note="random keys and values appended (no prefill)")

    def peer(context: int) -> OffloadRow:
        """Each layer filled by one update of the whole context (its updates concatenate: in
        chunks the fill would copy the growing past again each time), offloaded as it goes."""
        name = "transformers DynamicCache(offloading=True), bf16"
        cache = DynamicCache(config=net.config, offloading=True)
        g = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(1, shape.kv_heads, context, shape.head_dim, generator=g, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(shape.layers):
            cache.update(k, k, layer)
        torch.cuda.synchronize()
        fill_s = time.perf_counter() - t0
        del k
        step = decode(cache, context)
        del cache
        release_pinned()  # (its offloaded layers went to pinned memory, which torch keeps cached)
        return OffloadRow(name, context, step, fill_s=fill_s, note="random keys and values (no prefill)")

    for context in sorted(set(contexts) | set(peer_contexts)):
        start = len(rows)
        if context in peer_contexts:
            measured("transformers DynamicCache(offloading=True), bf16", context, lambda c=context: peer(c))
        if context in contexts or context in peer_contexts:
            for fmt in formats:
                measured(f"LongCtxCache {fmt} + host tier", context, lambda f=fmt, c=context: ours(f, c, True))
                if full_gpu:
                    measured(f"LongCtxCache {fmt}, all on the GPU", context, lambda f=fmt, c=context: ours(f, c, False))
        base = [r for r in rows[start:] if r.name.startswith("transformers") and r.step_ms == r.step_ms]
        for r in rows[start:]:
            if base and not r.name.startswith(("transformers", "PCIe")):
                r.speedup = base[0].step_ms / r.step_ms
    return rows


@dataclass
class PrefillRow:
    name: str
    context: int
    prefill_s: float
    peak_gib: float  # torch.cuda.max_memory_allocated() over the prefill and the decode after it
    budget_gib: float  # the cap (nan: none)
    host_gib: float = 0.0  # the host tier's bytes after the prefill
    ratio: float = float("nan")  # this prefill's time / the uncapped one's
    same_tokens: int = -1  # the leading greedy tokens after the prefill equal to the uncapped run's, of `decode` (-1: the uncapped row)
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def bench_offload_prefill(model: str = "llama-3.1-8b", context: int = 393216, fmt: str = "int4", weights_bits: int = 4, budget_gib: float = 16.0,
                          chunk: int = 8192, decode: int = 64, progress=None) -> list[PrefillRow]:
    """Prefill `context` random token ids through the model into LongCtxCache (`fmt`) with a
    host tier, the process capped at `budget_gib`, then `decode` greedy tokens; and the same
    with no cap, all on the GPU. progress(tokens_done, tokens) follows each prefill."""
    from ..generate import prefill
    from ..integrations.transformers import LongCtxCache
    from ..offload import host_memory_available

    check_offload_options([fmt], [context], [], weights_bits, budget_gib, decode)
    if chunk < 1:
        raise ValueError(f"bench offload: chunk must be at least 1, got {chunk}")
    if not torch.cuda.is_available():
        raise BackendUnavailableError("bench offload needs a CUDA GPU; this machine has none")
    if weights_bits == 4:
        importlib.import_module("bitsandbytes")
    shape = model_shape(model)
    total = torch.cuda.get_device_properties(0).total_memory
    net = random_model(shape, context + decode + 16)
    if weights_bits == 4:
        to_nf4(net)
    bits = FORMATS[fmt]
    ids = torch.randint(0, shape.vocab, (1, context), generator=torch.Generator().manual_seed(0))
    p = plan(shape, "budget", budget_gib, weights_bits=weights_bits, kv_bits=(bits,), prefill_chunk=chunk,
             host_gib=host_memory_available() * 0.8 / GIB).rows[0]
    blocks = -(-(context + decode) // 64) + 8
    if p.max_tokens_offload is None:
        raise ValueError(f"bench offload: {budget_gib:g} GiB has no room for a host tier's device part at chunks of {chunk:,}")
    capped = bits_format(bits, max_blocks=p.offload_max_blocks, host_blocks=max(1, blocks - p.offload_max_blocks))
    rows: list[PrefillRow] = []
    tokens: list[list[int]] = []
    for name, cfg, cap in ((f"LongCtxCache {fmt}, no budget", bits_format(bits), None),
                           (f"LongCtxCache {fmt} + host tier, {budget_gib:g} GiB budget", capped, budget_gib)):
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cache = LongCtxCache(net, cfg)
        note = ""
        out: list[int] = []
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                logits = prefill(net, cache, ids, chunk=chunk, all_logits=False,
                                 on_chunk=None if progress is None else lambda n, _l: progress(n, context))
                cache.paged.seal()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                for t in greedy_steps(net, cache, logits.argmax(-1, keepdim=True), decode):
                    out.append(t)
            host = cache.paged.memory_report().bytes_by_tier["host"]
        except Exception as e:
            if not out_of_memory(e):
                raise
            seconds, host, note = float("nan"), 0, "out of GPU memory"
        finally:
            cache.detach()
            torch.cuda.set_per_process_memory_fraction(1.0)
        row = PrefillRow(name, context, seconds, torch.cuda.max_memory_allocated() / GIB, cap if cap is not None else float("nan"),
                         host / GIB, note=note)
        tokens.append(out)
        cache = logits = None  # (the uncapped run's pages go before the capped run starts)
        if rows:
            row.ratio = row.prefill_s / rows[0].prefill_s
            row.same_tokens = 0  # (the leading greedy tokens both runs chose alike)
            for a, b in zip(tokens[0], out):
                if a != b:
                    break
                row.same_tokens += 1
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
    return rows
