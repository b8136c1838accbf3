"""Where an eager decode step's time goes in the end-to-end model (`bench e2e`'s random
Llama-3-8B-shaped model, bf16 weights, batch 1): ms a token with DynamicCache + SDPA and with
LongCtxCache; each one's host time by entry (perf_counter timers around the cache's update,
the attention function and, for LongCtxCache, append, view, paged_attention and the Triton
launcher); where a step synchronizes with the GPU (torch's sync debug mode); then a cProfile
of LongCtxCache's steps. On the H200's host the step is bound by the host at short contexts,
and the host's speed varies from machine to machine: compare runs of one call only.

Usage (GPU machine, repo root): python3 scripts/diag_step.py [--context 4096] [--steps 32] [--format int4] [--save FILE]
"""
import argparse
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from transformers import DynamicCache  # noqa: E402

from longctx.bench import _config, llama3_8b_shaped  # noqa: E402
from longctx.integrations.transformers import LongCtxCache, cache_kwargs  # noqa: E402


@torch.inference_mode()
def per_token_ms(model, ids, cache, steps: int, prof=None, before=None) -> float:
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3):  # compiles, first seal
        tok = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    if before is not None:
        before()
    if prof is not None:
        prof.enable()
    t = time.perf_counter()
    for _ in range(steps):
        tok = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    if prof is not None:
        prof.disable()
    return dt / steps * 1e3


def timed(obj, name: str, acc: dict, label: str):
    """Wrap obj.name so that each call's host time (perf_counter, no sync) adds to acc[label]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

    setattr(obj, name, wrapper)
    return fn


def host_split(model, ids, make_cache, steps: int) -> tuple[float, dict]:
    """Host seconds a token in each wrapped entry (nested ones overlap), without a profiler."""
    import longctx.cache as C
    import longctx.integrations.transformers as T
    import longctx.ops.paged_attention.triton as K

    acc: dict = {}
    spots = [(C.PagedKVCache, "append", "PagedKVCache.append"), (C.PagedKVCache, "view", "PagedKVCache.view"),
             (C, "paged_attention", "paged_attention"), (K, "paged_decode_triton", "paged_decode_triton"),
             (K, "_setup", "triton _setup"), (T.LongCtxCache, "update", "LongCtxCache.update"),
             (DynamicCache, "update", "DynamicCache.update")]
    saved = [(obj, name, timed(obj, name, acc, label)) for obj, name, label in spots]
    names, old, reg = [], {}, {}
    try:
        cache = make_cache()  # (LongCtxCache registers its attention on attach: wrap after it)
        # the attention functions are looked up by name at call time: wrap them where they are registered
        from transformers import AttentionInterface
        reg = AttentionInterface._global_mapping
        names = [n for n in (T.ATTN_NAME, "sdpa") if n in reg]
        old = {n: reg[n] for n in names}
        for n in names:
            f = old[n]

            def w(*args, _f=f, _n=n, **kwargs):
                t = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    acc["attention fn " + _n] = acc.get("attention fn " + _n, 0.0) + time.perf_counter() - t

            reg[n] = w
        ms = per_token_ms(model, ids, cache, steps, before=acc.clear)
        if hasattr(cache, "detach"):
            cache.detach()
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        reg.update(old)
    return ms, {k: v / steps for k, v in acc.items()}


def sync_sites(model, ids, make_cache, steps: int = 2) -> list[str]:
    """Where a decode step synchronizes with the GPU: torch's sync debug mode, each warning's
    innermost frames outside torch."""
    import traceback
    import warnings

    cache = make_cache()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            tok = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        sites: dict = {}

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename]
            key = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-4:][::-1])
            sites[key] = sites.get(key, 0) + 1

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():  # (which puts showwarning back on exit)
                warnings.simplefilter("always")
                warnings.showwarning = record
                for _ in range(steps):
                    tok = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if hasattr(cache, "detach"):
        cache.detach()
    return [f"{n / steps:g} a step: {k}" for k, n in sorted(sites.items(), key=lambda kv: -kv[1])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--format", default="int4")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--save", default=None, help="also write the profiles here (FILE.dynamic.prof, FILE.longctx.prof: pstats)")
    a = ap.parse_args()
    model = llama3_8b_shaped(a.layers, a.context + a.steps + 64, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0)).to("cuda")
    per_token_ms(model, ids, DynamicCache(config=model.config), 4)  # (a process's first run is slower: not timed)
    print(f"DynamicCache + SDPA: {per_token_ms(model, ids, DynamicCache(config=model.config), a.steps):.2f} ms a token", flush=True)
    prof = cProfile.Profile()
    ms = per_token_ms(model, ids, DynamicCache(config=model.config), a.steps, prof)
    print(f"DynamicCache + SDPA under cProfile: {ms:.2f} ms a token", flush=True)
    if a.save:
        prof.dump_stats(a.save + ".dynamic.prof")
    cache = LongCtxCache(model, _config(a.format, 64))
    print(f"LongCtxCache {a.format}: {per_token_ms(model, ids, cache, a.steps):.2f} ms a token", flush=True)
    cache.detach()
    for name, make in (("DynamicCache + SDPA", lambda: DynamicCache(config=model.config)),
                       (f"LongCtxCache {a.format}", lambda: LongCtxCache(model, _config(a.format, 64)))):
        ms, split = host_split(model, ids, make, a.steps)
        print(f"{name}, host time a token by entry (timers): {ms:.2f} ms a token", flush=True)
        for k, v in sorted(split.items(), key=lambda kv: -kv[1]):
            print(f"  {k:28s} {v * 1e3:8.3f} ms a token, {v * 1e6 / a.layers:8.1f} us a layer")
        print(f"{name}, host syncs in a decode step:", *(sync_sites(model, ids, make) or ["none"]), sep="\n  ", flush=True)
    cache = LongCtxCache(model, _config(a.format, 64))
    prof = cProfile.Profile()
    ms = per_token_ms(model, ids, cache, a.steps, prof)
    cache.detach()
    print(f"LongCtxCache {a.format} under cProfile: {ms:.2f} ms a token; per token and layer below (us = s / steps / layers * 1e6)")
    if a.save:
        prof.dump_stats(a.save + ".longctx.prof")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats("longctx", 30)
    st.print_callees("_storage_op|wrapper")


if __name__ == "__main__":
    main()
