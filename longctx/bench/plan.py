"""`bench plan`: `longctx plan`'s prediction against a measured peak on this GPU.

A random-initialized model of a catalog model's shape (a Llama-architecture stand-in with its
layers, widths, heads and vocabulary: the same parameter count, so the same weight bytes),
bf16 weights or bitsandbytes NF4 (every decoder Linear as `Linear4bit`, fp32 absmax per 64
weights, as `load_model(load_in_4bit=True)` quantizes), limited to a memory budget with
`torch.cuda.set_per_process_memory_fraction`. The context is what `plan` says fits in that
budget for the format; the bench prefills that many random tokens in plan's chunk, decodes a
few, and compares the allocator's peak with plan's weights + KV + activations (the CUDA
context and plan's reserve are not allocator memory).

With `gpus` > 1 the model is split over that many cards by plan's layers a card (accelerate's
dispatch, `longctx.models.split_device_map`), each card capped at the budget, and each card's
peak is set beside plan's prediction for it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from ..config import bits_format
from ..errors import BackendUnavailableError
from ..plan import activation_bytes, card_peaks, kv_bytes, model_shape, plan, weight_bytes
from .common import out_of_memory
from .e2e import random_llama

GIB = 2**30
FORMATS = {"bf16": 16, "int8": 8, "int4": 4, "int2+rot": 2, "int2": 2}  # plan's formats (blocks of 64 tokens)


@dataclass
class PlanCheckRow:
    model: str
    format: str
    weights_bits: int
    budget_gib: float
    tokens: int  # prefilled (plan's context, or --max-tokens where lower)
    planned_tokens: int  # what plan says fits
    predicted_gib: float  # weights + KV + activations at `tokens`
    peak_gib: float  # torch.cuda.max_memory_allocated() over the prefill and decode
    weights_predicted_gib: float
    weights_measured_gib: float
    seconds: float
    note: str = ""  # where it stopped, if the budget ran out
    gpus: int = 1  # cards of `budget_gib` each, the model split over them by layers
    layers_per_gpu: list[int] = field(default_factory=list)
    predicted_by_gpu_gib: list[float] = field(default_factory=list)  # each card's weights + KV + activations
    peak_by_gpu_gib: list[float] = field(default_factory=list)  # each card's allocator peak

    @property
    def peak_over_predicted(self) -> float:
        return self.peak_gib / self.predicted_gib

    def as_dict(self) -> dict:
        return {**asdict(self), "peak_over_predicted": self.peak_over_predicted}


def random_model(shape, max_positions: int, device: str = "cuda"):
    """A random-initialized Llama-architecture model of `shape` (a plan.ModelShape), bf16."""
    from transformers import LlamaConfig

    return random_llama(LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                                    num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                                    vocab_size=shape.vocab, tie_word_embeddings=shape.tied, attention_bias=shape.qkv_bias,
                                    max_position_embeddings=max_positions, attn_implementation="sdpa"), device)


def to_nf4(model, devices: list | None = None) -> None:
    """Every decoder Linear replaced by bitsandbytes' Linear4bit (NF4, no double quantization),
    quantized on the GPU (devices: each layer's, default "cuda"); embeddings, norms and the LM
    head stay bf16."""
    import bitsandbytes as bnb

    for i, layer in enumerate(model.model.layers):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, compress_statistics=False, quant_type="nf4", device="cpu")
                    q.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, compress_statistics=False, quant_type="nf4")
                    setattr(parent, name, q.to(devices[i] if devices else "cuda"))
                    del child
    torch.cuda.empty_cache()


def check_plan_options(fmt: str, weights_bits: int, budget_gib: float | None, chunk: int, decode: int, max_tokens: int | None,
                       gpus: int = 1) -> None:
    """Bad values, refused before a model or a GPU is needed."""
    if gpus < 1:
        raise ValueError(f"bench plan: gpus must be at least 1, got {gpus}")
    if fmt not in FORMATS:
        raise ValueError(f"bench plan: unknown format {fmt!r}; plan's formats are {', '.join(FORMATS)}")
    if weights_bits not in (16, 4):
        raise ValueError(f"bench plan: weights bits must be 16 (bf16) or 4 (bitsandbytes NF4), got {weights_bits}")
    for name, value in (("chunk", chunk), ("decode", decode)):
        if value < 1:
            raise ValueError(f"bench plan: {name} must be at least 1, got {value}")
    if budget_gib is not None and budget_gib <= 0:
        raise ValueError(f"bench plan: the budget must be more than 0 GiB, got {budget_gib}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"bench plan: max_tokens must be at least 1, got {max_tokens}")


def bench_plan(model: str = "llama-3.1-8b", fmt: str = "int4", weights_bits: int = 16, budget_gib: float | None = None, chunk: int = 2048,
               decode: int = 8, max_tokens: int | None = None, progress=None, gpus: int = 1) -> PlanCheckRow:
    """Prefill the context `plan` gives for `fmt` within `budget_gib` (None: the GPU's memory),
    decode `decode` tokens, and report plan's prediction beside the measured peak.
    progress(tokens_done, tokens) follows the prefill. gpus: the model split over that many
    cards of `budget_gib` each (see the module)."""
    from ..generate import prefill
    from ..integrations.transformers import LongCtxCache, cache_kwargs

    check_plan_options(fmt, weights_bits, budget_gib, chunk, decode, max_tokens, gpus)
    shape = model_shape(model)
    bits = FORMATS[fmt]
    if not torch.cuda.is_available():
        raise BackendUnavailableError("bench plan needs a CUDA GPU; this machine has none")
    if gpus > torch.cuda.device_count():
        raise BackendUnavailableError(f"bench plan --gpus {gpus} needs {gpus} CUDA GPUs; this machine has {torch.cuda.device_count()}")
    totals = [torch.cuda.get_device_properties(d).total_memory for d in range(gpus)]
    budget = budget_gib if budget_gib is not None else min(totals) / GIB
    if budget * GIB > min(totals):
        raise ValueError(f"bench plan: a budget of {budget:.1f} GiB is more than this GPU's {min(totals) / GIB:.1f} GiB")
    row = plan(shape, "budget", budget, weights_bits=weights_bits, kv_bits=(bits,), prefill_chunk=chunk, gpus=gpus).rows[0]
    if row.unavailable or row.max_tokens == 0:
        raise ValueError(f"bench plan: {fmt} does not fit {model} in {gpus} x {budget:.1f} GiB ({row.unavailable or 'not even one token'})")
    tokens = min(row.max_tokens, max_tokens or row.max_tokens)
    fmt = bits_format(bits, block_size=64)  # (plan's, as `plan` above builds it)
    sealed = tokens // fmt.block_size  # the pools sized for `tokens` (allocated at once: what plan counts), not plan's longest
    cfg = bits_format(bits, block_size=64, max_blocks=max(1, sealed - min(fmt.sink_blocks, sealed)))
    if weights_bits == 4:
        import bitsandbytes  # noqa: F401  (refused in one line before a model is built where it is missing)
    counts = row.layers_per_gpu
    if gpus == 1:
        net = random_model(shape, tokens + decode + 16)
        if weights_bits == 4:
            to_nf4(net)
    else:  # built on the host, each layer quantized on its card, then dispatched by the split
        from accelerate import dispatch_model

        from ..models import split_device_map

        net = random_model(shape, tokens + decode + 16, device="cpu")
        devices = [f"cuda:{d}" for d, n in enumerate(counts) for _ in range(n)]
        if weights_bits == 4:
            to_nf4(net, devices)
        dispatch_model(net, device_map=split_device_map(net, counts))
    for d, total in enumerate(totals):
        torch.cuda.synchronize(d)
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget * GIB / total), d)
        torch.cuda.reset_peak_memory_stats(d)
    weights = sum(torch.cuda.memory_allocated(d) for d in range(gpus))
    ids = torch.randint(0, shape.vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = LongCtxCache(net, cfg)
    t0, note = time.perf_counter(), ""
    try:
        with torch.inference_mode():
            done = [0]

            def on_chunk(n, _logits):
                done[0] = n
                if progress is not None:
                    progress(n, tokens)

            logits = prefill(net, cache, ids, chunk=chunk, all_logits=False, on_chunk=on_chunk)
            tok = logits.argmax(-1, keepdim=True)
            for _ in range(decode):
                tok = net(input_ids=tok, use_cache=True, **cache_kwargs(net, cache)).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    except Exception as e:
        if not out_of_memory(e):
            raise
        note = f"out of memory after {done[0]:,} of {tokens:,} prompt tokens"
    finally:
        cache.detach()
        for d in range(gpus):
            torch.cuda.set_per_process_memory_fraction(1.0, d)
    predicted = weight_bytes(shape, weights_bits) + kv_bytes(shape, cfg, tokens) + activation_bytes(shape, chunk, tokens)
    peaks = [torch.cuda.max_memory_allocated(d) / GIB for d in range(gpus)]
    out = PlanCheckRow(model, fmt, weights_bits, budget, tokens, row.max_tokens, predicted / GIB, max(peaks),
                       weight_bytes(shape, weights_bits) / GIB, weights / GIB, time.perf_counter() - t0, note, gpus=gpus)
    if gpus > 1:  # each card against its own prediction; the row's figures are the fullest card's
        by_card = [n / GIB for n in card_peaks(shape, cfg, counts, tokens, weights_bits, 1, chunk)]
        out.layers_per_gpu, out.predicted_by_gpu_gib, out.peak_by_gpu_gib = counts, by_card, peaks
        worst = max(range(gpus), key=lambda d: peaks[d] / by_card[d])
        out.predicted_gib, out.peak_gib = by_card[worst], peaks[worst]
    return out
