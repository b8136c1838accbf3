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
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed input_ids [B, T] into `cache` in chunks; returns the last position's logits [B, V].

    on_chunk(tokens_done, logits [B, C, V]) is called after every chunk (progress, scoring).
    all_logits=False computes only each chunk's last position (logits [B, 1, V]): a chunk of
    C tokens then never holds C x vocab logits (what `longctx plan` assumes for generation).
    attention_mask [B, N + T]: left padding, over the N tokens the cache already holds and
    these T; each chunk gets its prefix of the mask and each row's positions (padding skipped).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"prefill: input_ids must be [batch, tokens>0], got {tuple(input_ids.shape)}")
    if chunk < 1:
        raise ValueError(f"prefill: chunk must be >= 1, got {chunk}")
    kw = cache_kwargs(model, cache)
    if not all_logits and "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    past = 0
    if attention_mask is not None:
        past = attention_mask.shape[1] - input_ids.shape[1]
        if attention_mask.shape[0] != input_ids.shape[0] or past < 0:
            raise ValueError(f"prefill: attention_mask {tuple(attention_mask.shape)} must cover the cached tokens and input_ids {tuple(input_ids.shape)}")
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    logits = None
    for c0 in range(0, input_ids.shape[1], chunk):
        ids = input_ids[:, c0 : c0 + chunk].to(model.device)
        if attention_mask is not None:
            c1 = past + c0 + ids.shape[1]
            kw.update(attention_mask=attention_mask[:, :c1], position_ids=positions[:, past + c0 : c1])
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


PREFILL_CHUNK = 512  # graph_decoding's prefill chunk where the generation config sets none


def graph_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus: bool = False,
                   streamer=None, graphs: bool | None = None, on_token: Callable[[torch.Tensor], None] | None = None, **model_kwargs):
    """A decoding method for transformers' `generate`, over a LongCtxCache, with decode steps
    replayed from CUDA graphs where they serve:

        model.generate(ids, cache=LongCtxCache(model, KVConfig(bits=4)), max_new_tokens=256,
                       custom_generate=longctx.graph_decoding)

    (`past_key_values=` on transformers that take that name). Greedy and sampling (num_beams
    1), with generate's logits processors (temperature, top-k/p, repetition penalty, ...),
    stopping criteria (max length, EOS, stop strings) and `return_dict_in_generate` (scores and
    logits; not attentions or hidden states), as generate's own loop gives them.

    Two keywords of its own, which generate() hands to it: `graphs` (None: graphs where they
    serve, else eager steps; True: raise where they cannot; False: eager steps) and `on_token`,
    called with each step's new tokens [B] (on the host). Stream with `on_token`:
    transformers' generate (5.17 to 5.24 at least) does not pass its `streamer` to a custom
    decoding method. It puts the prompt into the streamer and never ends it, so a
    TextIteratorStreamer's reader would wait forever. A streamer that does arrive is used.

    The prompt's tokens that the cache does not hold yet are prefilled in chunks of the
    generation config's `prefill_chunk_size` (else PREFILL_CHUNK). Decode steps come from
    `GraphDecoder` where it serves (CUDA, the triton backend; left-padded rows too, their
    padding given to it as each row's start); elsewhere, and after a failed recording
    (warned once), they run eagerly, as generate's loop would. The cache then holds the
    prompt and every new token but the last, as after generate's own loop. Beam search,
    assisted decoding and other inputs raise ValueError: call generate without
    `custom_generate` for them."""
    import dataclasses

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from .graphs import GraphDecoder, graph_decoder
    from .integrations.transformers import LongCtxCache, start_offsets

    gc = generation_config
    kw = dict(model_kwargs)
    name = next((k for k in ("cache", "past_key_values") if isinstance(kw.get(k), LongCtxCache)), None)
    if name is None:
        given = {k: type(kw[k]).__name__ for k in ("cache", "past_key_values") if kw.get(k) is not None}
        raise ValueError(f"graph_decoding decodes over a LongCtxCache: pass cache=LongCtxCache(model, KVConfig(...)) to generate(), got {given or 'no cache'}")
    cache = kw.pop(name)
    mask = kw.pop("attention_mask", None)
    for k in ("position_ids", "cache_position", "logits_to_keep", "use_cache"):  # (recomputed here from the mask and the cache)
        kw.pop(k, None)
    extra = sorted(k for k, v in kw.items() if v is not None)
    if extra:
        raise ValueError(f"graph_decoding takes input ids, an attention mask and the cache; generate() also passed {extra}: call it without custom_generate")
    if gc.num_beams > 1:
        raise ValueError(f"graph_decoding decodes one hypothesis a row (num_beams=1), got num_beams={gc.num_beams}: for beam search call generate() without custom_generate")
    if synced_gpus:
        raise ValueError("graph_decoding runs on one device: synced_gpus is not supported")
    if gc.return_dict_in_generate and (gc.output_attentions or gc.output_hidden_states):
        raise ValueError("graph_decoding returns scores and logits, not attentions or hidden states: call generate() without custom_generate for them")
    if not gc.use_cache:
        raise ValueError("graph_decoding decodes over the cache: use_cache=False is not supported")

    B, T = input_ids.shape
    done = cache.get_seq_length()
    if done >= T:
        raise ValueError(f"graph_decoding: the cache already holds {done} tokens and the prompt has {T}: there is nothing new to feed")
    padded = mask is not None and not bool(mask.all())
    if graphs:  # (before a long prefill)
        why = GraphDecoder.unsupported(model, cache, empty_ok=True)
        if why:
            raise ValueError(f"graphs=True: {why}")
    chunk = getattr(gc, "prefill_chunk_size", None) or PREFILL_CHUNK
    logits = prefill(model, cache, input_ids[:, done:], chunk=chunk, all_logits=False, attention_mask=mask if padded else None)
    logits = logits.to(torch.float32, copy=True)  # (made in inference mode: a plain tensor for the processors)
    positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)[:, -1:] if padded else None  # each row's last prompt position
    ck = cache_kwargs(model, cache)

    start = start_offsets(mask.to(model.device), T) if padded else None  # (each row's padding; prefill checked the mask)
    decoder = graph_decoder(model, cache, graphs, start=start)
    scores = () if gc.return_dict_in_generate and gc.output_scores else None
    raw = () if gc.return_dict_in_generate and gc.output_logits else None
    eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    pad = gc._pad_token_tensor
    if eos and pad is None:
        raise ValueError("graph_decoding: generation stops at an EOS token but no pad_token_id is set (generate() sets one from eos_token_id)")
    unfinished = torch.ones(B, dtype=torch.long, device=input_ids.device)
    while True:
        next_scores = logits_processor(input_ids, logits)
        if scores is not None:
            scores += (next_scores,)
        if raw is not None:
            raw += (logits,)
        if gc.do_sample:
            tokens = torch.multinomial(torch.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = next_scores.argmax(-1)
        if eos:  # finished rows take the pad token
            tokens = tokens * unfinished + pad.to(tokens.device) * (1 - unfinished)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        if streamer is not None or on_token is not None:
            host = tokens.cpu()
            if streamer is not None:
                streamer.put(host)
            if on_token is not None:
                on_token(host)
        unfinished = unfinished & ~stopping_criteria(input_ids, next_scores)
        if unfinished.max() == 0:
            break
        ids = tokens[:, None].to(model.device)
        if decoder is not None:
            logits = decoder.step(ids).to(torch.float32, copy=True)  # (a graph's buffer: the next replay overwrites it)
        else:
            step = {}
            if padded:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=-1)
                step = dict(attention_mask=mask, position_ids=positions[:, -1:] + 1)
                positions = step["position_ids"]
            logits = model(input_ids=ids, use_cache=True, **ck, **step).logits[:, -1].to(torch.float32, copy=True)
    if streamer is not None:
        streamer.end()
    if not gc.return_dict_in_generate:
        return input_ids
    fields = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw, **{"cache" if "cache" in fields else "past_key_values": cache})
