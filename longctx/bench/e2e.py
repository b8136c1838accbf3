"""`bench e2e`: decode tokens/s and prefill time of a random-initialized Llama-3-8B-shaped model
with longctx's cache against transformers' DynamicCache + SDPA and StaticCache +
torch.compile."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from .common import out_of_memory, bench_setup, sealing_share


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


def llama3_8b_shaped(layers: int = 32, max_positions: int = 1 << 20, device: str = "cuda"):
    """A random-initialized model with Llama-3-8B's shapes, bf16 weights, SDPA attention."""
    from transformers import LlamaConfig

    return random_llama(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=max_positions, rope_theta=500000.0,
                                    attn_implementation="sdpa"), device)


def random_llama(cfg, device: str = "cuda"):
    """A random-initialized LlamaForCausalLM of `cfg` (a LlamaConfig), built in bf16 on `device`."""
    from transformers import LlamaForCausalLM

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
              device: str = "cuda", progress=None, warmup: int = 2, graphs: bool = True, compiled: bool = True,
              device_map: str | None = None) -> list[E2ERow]:
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
    with the next cache.

    device_map="auto": LongCtxCache on one card against the same model split over every
    visible GPU (`longctx.plan.split_layers`' layers a card, dispatched by accelerate), each
    format: the one-card rows first (eager, and from CUDA graphs), then the split model's
    eager row ("on N GPUs"), whose `ratio_decode` is the one-card eager step's time over its
    own and whose note gives each card's peak and whether its greedy tokens equal the one-card
    run's. No DynamicCache or compiled rows."""
    import gc
    import time

    from transformers import DynamicCache

    from ..integrations.transformers import LongCtxCache, cache_kwarg_name, cache_kwargs

    for what, n, least in (("context", context, 1), ("chunk", chunk, 1), ("new_tokens", new_tokens, 1), ("layers", layers, 1),
                            ("warmup", warmup, 0)):
        if n < least:
            raise ValueError(f"{what} must be at least {least}, got {n}")
    if device_map not in (None, "auto"):
        raise ValueError(f"device_map must be auto or None, got {device_map!r}")
    cfgs, _, _, _ = bench_setup("e2e", formats, 64)  # bad values and names fail before a 16 GB model is built
    model = llama3_8b_shaped(layers, context + 2 * (warmup + new_tokens) + 16, device)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).to(device)

    rows: list[E2ERow] = []
    tokens: dict[str, list] = {}  # each row's greedy tokens
    now = {"row": "", "stage": ""}  # the row being measured and where, for an out-of-memory note

    def guarded(measure, *args) -> None:
        """`measure(*args)`, which appends its rows; when the GPU runs out of memory on the way,
        the row it was measuring gets no figures and a note instead."""
        try:
            measure(*args)
        except Exception as e:
            if not out_of_memory(e):
                raise
            nan = float("nan")
            rows.append(E2ERow(now["row"], context, nan, nan, torch.cuda.max_memory_allocated() / 2**30,
                               note=f"out of GPU memory in {now['stage']}"))
            if progress is not None:
                progress(rows[-1])
        gc.collect()  # (what the failed row held, before the next one allocates)
        torch.cuda.empty_cache()

    def decode(cache, tok, steps: int, marks: list | None = None, decoder=None, out: list | None = None):
        """`steps` greedy tokens, eager or from `decoder` (a GraphDecoder over `cache`); with
        `marks`, appends (an event recorded at the step's start, whether the step sealed or
        recorded a graph) per step and one end event (sealed None); with `out`, the tokens."""
        paged = getattr(cache, "paged", None)
        for _ in range(steps):
            if out is not None:
                out.append(tok)
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
        """`warmup` untimed steps, then `new_tokens` timed ones: (the row, the last token); the
        greedy tokens go to tokens[name]."""
        now["stage"] = "decode" if decoder is None else "decode from CUDA graphs"
        tokens[name] = []
        tok = decode(cache, tok, warmup, decoder=decoder, out=tokens[name])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        marks: list = []
        tok = decode(cache, tok, new_tokens, marks, decoder, tokens[name])
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

    def prefill(kw: dict, positions: bool = False):
        """The prompt in chunks into the cache `kw` passes (each chunk's cache_position too with
        `positions`, as StaticCache needs): (the next token, the time it started)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for s in range(0, context, chunk):
            now["stage"] = f"prefill, at token {s:,} of {context:,}"
            e = min(context, s + chunk)
            at = {"cache_position": torch.arange(s, e, device=device)} if positions else {}
            out = model(input_ids=ids[:, s:e], use_cache=True, logits_to_keep=1, **at, **kw)
        return out.logits[:, -1:].argmax(-1), t0

    def prefill_and_decode(name, cache) -> None:
        with torch.inference_mode():
            tok, t0 = prefill(cache_kwargs(model, cache))
            if isinstance(cache, LongCtxCache):  # seal the prompt's last chunk here, not in the first decode step
                cache.paged.seal()
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            row, tok = timed(name, cache, tok, prefill_s)
        rows.append(row)
        if not (graphs and isinstance(cache, LongCtxCache)):
            return
        from ..graphs import GraphDecoder

        if GraphDecoder.unsupported(model, cache):  # (a split model: eager steps, GraphDecoder says why)
            return

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

        # no_grad, not inference_mode: the compiled step's CUDA graphs take the cache's tensors as
        # ordinary inputs, and tensors made in inference mode cannot be
        with torch.no_grad():
            tok, t0 = prefill(kw, positions=True)
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

    if device_map is not None:
        return _split_rows(model, cfgs, run, guarded, rows, tokens, context, chunk, layers)
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


def _split_rows(model, cfgs: dict, run, guarded, rows: list[E2ERow], tokens: dict, context: int, chunk: int, layers: int) -> list[E2ERow]:
    """bench_e2e's device_map="auto" rows: each format on one card, then on the model split
    over the visible GPUs (see bench_e2e)."""
    from accelerate import dispatch_model

    from ..integrations.transformers import LongCtxCache
    from ..models import split_device_map
    from ..plan import shape_from_config, split_layers

    for cfg in cfgs.values():
        guarded(run, f"LongCtxCache {cfg.describe()}", lambda cfg=cfg: LongCtxCache(model, cfg))
    n = torch.cuda.device_count()
    cards = [torch.cuda.get_device_properties(i).total_memory for i in range(n)]
    shape = shape_from_config(model.config.to_dict())
    first = next(iter(cfgs.values()))
    _, counts = split_layers(shape, first, cards, weights_bits=16, chunk=chunk)  # (the longest context's split: balanced)
    if not counts:  # (not a token fits the cards by plan's count: split the layers evenly)
        counts = [layers // n + (i < layers % n) for i in range(n)]
    dispatch_model(model, device_map=split_device_map(model, counts))
    split = " / ".join(map(str, counts))
    for cfg in cfgs.values():
        name = f"LongCtxCache {cfg.describe()}"
        here = f"{name} on {n} GPU{'s' * (n > 1)} ({split} layers)"
        for d in range(n):
            torch.cuda.reset_peak_memory_stats(d)
        guarded(run, here, lambda cfg=cfg: LongCtxCache(model, cfg))
        one = next((r for r in rows if r.name == name), None)
        for r in rows:  # ratios against the one-card eager row of the format
            if r.name.startswith(name) and one is not None and not one.note:
                r.ratio_decode = one.decode_ms_per_token / r.decode_ms_per_token
                r.ratio_prefill = r.prefill_s / one.prefill_s
        row = next((r for r in rows if r.name == here), None)
        if row is None or row.note or one is None or one.note:
            continue
        peaks = [torch.cuda.max_memory_allocated(d) / 2**30 for d in range(n)]
        row.peak_gib = max(peaks)
        same = torch.equal(torch.cat(tokens[name], 1).cpu(), torch.cat(tokens[here], 1).cpu())
        row.note = (f"peaks {', '.join(f'cuda:{d} {p:.1f}' for d, p in enumerate(peaks))} GiB; greedy tokens "
                    f"{'equal' if same else 'DIFFER from'} one card's")
    return rows
