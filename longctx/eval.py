"""Quality measurements of KV formats: perplexity, KL divergence from the exact cache and
top-1 agreement (chunked or decode-mode feeding), and passkey retrieval.

Results are dataclasses; rendering lives in cli/. A "cache spec" is what to measure:
- a `KVConfig`: a LongCtxCache of that format;
- None: transformers' DynamicCache (the exact baseline);
- a callable model -> Cache: any other cache (e.g. `quanto_cache(bits=4)`).
"""

from __future__ import annotations

import importlib.util
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import torch

from .config import KVConfig
from .errors import BackendUnavailableError
from .generate import greedy, prefill
from .integrations.transformers import cache_kwargs

CacheSpec = KVConfig | Callable | None


def default_text() -> str:
    """The English text shipped with longctx (about 2,700 SmolLM2 tokens)."""
    return resources.files("longctx.data").joinpath("english.txt").read_text(encoding="utf-8")


def spec_name(spec: CacheSpec) -> str:
    if spec is None:
        return "DynamicCache"
    if isinstance(spec, KVConfig):
        return f"longctx {spec.describe()}"
    return getattr(spec, "name", getattr(spec, "__name__", "custom cache"))


def make_cache(model, spec: CacheSpec):
    """Build the cache a spec names (see module doc)."""
    from transformers import DynamicCache

    from .integrations.transformers import LongCtxCache

    if spec is None:
        return DynamicCache(config=model.config)
    if isinstance(spec, KVConfig):
        return LongCtxCache(model, spec)
    return spec(model)


def has_quanto() -> bool:
    """Whether optimum-quanto (the quanto backend of Hugging Face's QuantizedCache) imports."""
    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


def quanto_cache(bits: int = 4):
    """Factory of Hugging Face's QuantizedCache with the quanto backend. It needs optimum-quanto,
    checked here, before any measurement runs (transformers would raise only when the cache is
    built, after the runs before it)."""
    if not has_quanto():
        raise BackendUnavailableError("Hugging Face's QuantizedCache with quanto needs optimum-quanto: pip install optimum-quanto")

    def build(model):
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=bits)

    build.name = f"HF QuantizedCache quanto int{bits}"
    return build


def _release(cache) -> None:
    detach = getattr(cache, "detach", None)
    if detach is not None:
        detach()


@dataclass
class PerplexityResult:
    name: str
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # tokens fed
    chunk: int
    seconds: float
    bytes_per_token: float | None = None  # longctx caches only
    ratio_to_bf16: float | None = None

    def delta_pct(self, baseline: PerplexityResult) -> float:
        return 100.0 * (self.ppl / baseline.ppl - 1.0)


def perplexity(
    model,
    tokenizer,
    text: str | None = None,
    kv: CacheSpec = None,
    *,
    chunk: int = 128,
    max_tokens: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of `text` fed `chunk` tokens at a time through a cache built from `kv`.

    Each chunk attends to itself exactly and to every earlier chunk through the cache, so a
    quantized cache is read back for all but the first chunk. on_progress(tokens_done,
    tokens_total) is called after each chunk.
    """
    text = default_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt").input_ids
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    if ids.shape[1] < 2:
        raise ValueError("perplexity needs at least 2 tokens of text")
    targets = ids[0, 1:].to(model.device)
    nll_sum = torch.zeros((), dtype=torch.float64)
    done = {"n": 0}

    def score(end: int, logits: torch.Tensor) -> None:
        start = done["n"]
        # logits at positions start..end-1 predict tokens start+1..end
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        tgt = targets[start:end]
        lp = lp[: tgt.shape[0]]
        nll_sum.add_(-lp.gather(1, tgt[:, None]).sum().double().cpu())
        done["n"] = end
        if on_progress is not None:
            on_progress(end, ids.shape[1])

    cache = make_cache(model, kv)
    t0 = time.perf_counter()
    try:
        prefill(model, cache, ids, chunk=chunk, on_chunk=score)
        report = cache.memory_report() if hasattr(cache, "memory_report") else None
    finally:
        _release(cache)
    n = targets.shape[0]
    nll = float(nll_sum) / n
    return PerplexityResult(
        name=spec_name(kv),
        ppl=math.exp(nll),
        nll=nll,
        tokens=ids.shape[1],
        chunk=chunk,
        seconds=time.perf_counter() - t0,
        bytes_per_token=report.bytes_per_token if report else None,
        ratio_to_bf16=report.ratio_to_bf16 if report else None,
    )


# ---------------------------------------------------------------------- quality against the exact cache
MODES = ("chunked", "decode")


@dataclass
class QualityResult:
    """One cache's scores over the scored tokens of a text, against the exact cache's
    distributions at the same tokens (the exact run itself: KL 0, top-1 agreement 1)."""

    name: str
    mode: str  # "chunked": the text fed `chunk` tokens a forward; "decode": its last tokens one a step
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    scored: int  # tokens scored
    tokens: int  # tokens fed
    chunk: int
    seconds: float
    kl_mean: float  # KL(exact || this) per scored token, nats
    kl_p99: float
    kl_max: float
    top1: float  # share of scored tokens whose most likely next token is the exact cache's
    bytes_per_token: float | None = None  # longctx caches only
    ratio_to_bf16: float | None = None

    def delta_pct(self, baseline: QualityResult) -> float:
        return 100.0 * (self.ppl / baseline.ppl - 1.0)


def quality(
    model,
    tokenizer,
    specs: list[tuple[str, CacheSpec]],
    text: str | None = None,
    *,
    mode: str = "chunked",
    chunk: int = 128,
    decode_tokens: int = 256,
    max_tokens: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[QualityResult]:
    """Perplexity, KL divergence from the exact cache and top-1 agreement of each cache in
    `specs` [(name, spec)], with the exact cache (DynamicCache) run once beside them: every
    cache takes the same forward in turn, so its logits are compared with the exact ones of
    that forward and no distribution is kept beyond it.

    mode "chunked": the text is fed `chunk` tokens a forward and every token after the first is
    scored (each chunk reads itself exactly, earlier chunks through the cache). mode "decode":
    all but the last `decode_tokens` + 1 tokens are prefilled in chunks, unscored, then the
    last ones are fed one a step and each prediction is scored, so every scored token reads all
    earlier ones through the cache (the sealed pages, and the unsealed tail of under a block).
    on_progress(forwards_done, forwards) follows the run. Returns the exact cache's result
    first, then one per spec."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    text = default_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt").input_ids
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    T = ids.shape[1]
    if T < 2:
        raise ValueError("quality needs at least 2 tokens of text")
    if mode == "decode" and not 1 <= decode_tokens <= T - 2:
        raise ValueError(f"decode mode scores 1 .. {T - 2} tokens of this {T}-token text, got decode_tokens={decode_tokens}")
    runs = [("exact (DynamicCache)", None)] + list(specs)
    # the forwards: (first, last) token indices fed, and whether their predictions are scored
    if mode == "chunked":
        steps = [(a, min(T, a + chunk), True) for a in range(0, T, chunk)]
    else:
        warm = T - decode_tokens - 1
        steps = [(a, min(warm, a + chunk), False) for a in range(0, warm, chunk)] + [(t, t + 1, True) for t in range(warm, T - 1)]
    targets = ids[0, 1:].to(model.device)
    caches = [make_cache(model, spec) for _, spec in runs]
    nll = [torch.zeros((), dtype=torch.float64) for _ in runs]
    kls: list[list[torch.Tensor]] = [[] for _ in runs]
    agree = [0] * len(runs)
    scored = 0
    seconds = [0.0] * len(runs)
    try:
        with torch.no_grad():
            for i, (a, b, score) in enumerate(steps):
                chunk_ids = ids[:, a:b].to(model.device)
                exact_lp = exact_top = None
                for r, cache in enumerate(caches):
                    t0 = time.perf_counter()
                    logits = model(input_ids=chunk_ids, use_cache=True, **cache_kwargs(model, cache)).logits[0].float()
                    seconds[r] += time.perf_counter() - t0
                    if not score:
                        continue
                    tgt = targets[a:b]
                    lp = torch.log_softmax(logits[: tgt.shape[0]], dim=-1)
                    nll[r] += -lp.gather(1, tgt[:, None]).sum().double().cpu()
                    top = lp.argmax(-1)
                    if r == 0:
                        exact_lp, exact_top = lp, top
                    kls[r].append((exact_lp.exp() * (exact_lp - lp)).sum(-1).clamp(min=0).double().cpu())
                    agree[r] += int((top == exact_top).sum())
                if score:
                    scored += min(b, T - 1) - a
                if on_progress is not None:
                    on_progress(i + 1, len(steps))
        reports = [c.memory_report() if hasattr(c, "memory_report") else None for c in caches]
    finally:
        for c in caches:
            _release(c)
    out = []
    for r, (name, _) in enumerate(runs):
        kl = torch.cat(kls[r])
        mean_nll = float(nll[r]) / scored
        rep = reports[r]
        out.append(QualityResult(name, mode, math.exp(mean_nll), mean_nll, scored, T, chunk, seconds[r], float(kl.mean()),
                                 float(torch.quantile(kl, 0.99)), float(kl.max()), agree[r] / scored,
                                 rep.bytes_per_token if rep else None, rep.ratio_to_bf16 if rep else None))
    return out


# ---------------------------------------------------------------------- passkey
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass
class PasskeyResult:
    name: str
    depth: float  # where the key sits, as a fraction of the filler
    key: str
    answer: str
    found: bool
    prompt_tokens: int


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: str) -> torch.Tensor:
    """Plain-text prompt of about `n_tokens` tokens: filler with the key hidden at `depth`,
    ending in "The pass key is" (a completion, which small base-like models follow best)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    frame = "There is important information hidden in a lot of irrelevant text. Find it and memorize it.\n\n"
    question = "\nWhat is the pass key? The pass key is"
    filler_len = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    overhead = len(tokenizer(frame + needle + question, add_special_tokens=False).input_ids)
    if n_tokens < overhead + filler_len:
        raise ValueError(f"a passkey prompt takes at least {overhead + filler_len} tokens (the instructions, the key and one "
                         f"passage of filler), got {n_tokens}")
    reps = (n_tokens - overhead) // filler_len
    cut = int(round(reps * depth))
    prompt = frame + FILLER * cut + needle + FILLER * (reps - cut) + question
    return tokenizer(prompt, return_tensors="pt").input_ids


def passkey(
    model,
    tokenizer,
    kv: CacheSpec = None,
    *,
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    n_tokens: int = 3600,
    seed: int = 0,
    chunk: int = 512,
    on_result: Callable[[PasskeyResult], None] | None = None,
) -> list[PasskeyResult]:
    """Hide a 5-digit key at each depth of ~n_tokens of filler; greedy-decode the answer.
    on_result(result) is called as each depth is done."""
    rng = random.Random(seed)
    results = []
    for depth in depths:
        key = str(rng.randint(10000, 99999))
        ids = passkey_prompt(tokenizer, n_tokens, depth, key)
        cache = make_cache(model, kv)
        try:
            out, _ = greedy(model, cache, ids, max_new_tokens=8, chunk=chunk)
        finally:
            _release(cache)
        answer = tokenizer.decode(out, skip_special_tokens=True)
        results.append(PasskeyResult(spec_name(kv), depth, key, answer.strip(), key in answer, ids.shape[1]))
        if on_result is not None:
            on_result(results[-1])
    return results


@dataclass
class NeedleGrid:
    """Passkey retrieval of one cache at every (length, depth): results[i][j] for lengths[i]
    and depths[j], each the `passkey` run of that length at that depth."""

    name: str
    lengths: list[int]
    depths: list[float]
    results: list[list[PasskeyResult]]

    @property
    def accuracy(self) -> float:
        cells = [r.found for row in self.results for r in row]
        return sum(cells) / len(cells)


def needle(
    model,
    tokenizer,
    kv: CacheSpec = None,
    *,
    lengths=(1024, 2048, 4096),
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    seed: int = 0,
    chunk: int = 512,
    on_result: Callable[[PasskeyResult], None] | None = None,
) -> NeedleGrid:
    """A needle map: `passkey` at each prompt length in `lengths` over `depths` (the same keys
    as `passkey(..., n_tokens=length, depths=depths, seed=seed)`, so a cell equals that run's)."""
    rows = [passkey(model, tokenizer, kv, depths=depths, n_tokens=n, seed=seed, chunk=chunk, on_result=on_result) for n in lengths]
    return NeedleGrid(spec_name(kv), list(lengths), list(depths), rows)
