"""Chunked prefill and a streaming decode loop over any transformers Cache.

Used by eval (perplexity, passkey), and by chat and bench. A prompt of any length is fed
in chunks of `chunk` tokens, so activation memory stays bounded and earlier chunks are
read back from the cache, as a long document would be.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .integrations.transformers import cache_kwargs


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0


@torch.inference_mode()
def prefill(
    model,
    cache,
    input_ids: torch.Tensor,
    *,
    chunk: int = 512,
    on_chunk: Callable[[int, torch.Tensor], None] | None = None,
    all_logits: bool = True,
) -> torch.Tensor:
    """Feed input_ids [B, T] into `cache` in chunks; returns the last position's logits [B, V].

    on_chunk(tokens_done, logits [B, C, V]) is called after every chunk (progress, scoring).
    all_logits=False computes only each chunk's last position (logits [B, 1, V]): a chunk of
    C tokens then never holds C x vocab logits (what `longctx plan` assumes for generation).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"prefill: input_ids must be [batch, tokens>0], got {tuple(input_ids.shape)}")
    if chunk < 1:
        raise ValueError(f"prefill: chunk must be >= 1, got {chunk}")
    kw = cache_kwargs(model, cache)
    if not all_logits and "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    logits = None
    for c0 in range(0, input_ids.shape[1], chunk):
        ids = input_ids[:, c0 : c0 + chunk].to(model.device)
        logits = model(input_ids=ids, use_cache=True, **kw).logits
        if on_chunk is not None:
            on_chunk(c0 + ids.shape[1], logits)
    return logits[:, -1].float()


@torch.inference_mode()
def greedy(
    model,
    cache,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    chunk: int = 512,
    eos_token_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
    graphs: bool | None = None,
) -> tuple[torch.Tensor, GenerationStats]:
    """Greedy decode after a chunked prefill of input_ids [1, T]. Returns (new ids [n], stats).

    graphs: decode steps replayed from CUDA graphs (`longctx.graphs.GraphDecoder`): None where
    they can serve (a LongCtxCache on the triton backend, on CUDA), True always (ValueError
    naming what is missing), False never (eager steps)."""
    from .graphs import GraphDecoder, graph_decoder

    if input_ids.shape[0] != 1:
        raise ValueError(f"greedy: one sequence at a time, got batch {input_ids.shape[0]}")
    why = GraphDecoder.unsupported(model, cache, empty_ok=True) if graphs else None
    if why:  # (before a long prefill)
        raise ValueError(f"graphs=True: {why}")
    stats = GenerationStats(prompt_tokens=input_ids.shape[1])
    t0 = time.perf_counter()
    logits = prefill(model, cache, input_ids, chunk=chunk)
    stats.prefill_s = time.perf_counter() - t0
    kw = cache_kwargs(model, cache)
    decoder = graph_decoder(model, cache, graphs)
    out = []
    t0 = time.perf_counter()
    for _ in range(max_new_tokens):
        tok = int(logits[0].argmax())
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if eos_token_id is not None and tok == eos_token_id:
            break
        ids = torch.tensor([[tok]], device=model.device)
        if decoder is not None:
            logits = decoder.step(ids).float()
        else:
            logits = model(input_ids=ids, use_cache=True, **kw).logits[:, -1].float()
    stats.decode_s = time.perf_counter() - t0
    stats.new_tokens = len(out)
    return torch.tensor(out, dtype=torch.long), stats
