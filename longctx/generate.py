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
    stopped: str = ""  # why decoding stopped before EOS or the token limit, where it did

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

    (`past_key_values=` on transformers that take that name). Greedy, sampling and beam search
    (`num_beams`, with or without sampling), with generate's logits processors (temperature,
    top-k/p, repetition penalty, ...), stopping criteria (max length, EOS, stop strings),
    beam search's `length_penalty`, `early_stopping` and `num_return_sequences`, and
    `return_dict_in_generate` (scores, logits, and for beams sequences_scores and
    beam_indices; not attentions or hidden states), as generate's own loops give them.
    Sampled beams keep the best of their samples as transformers 5.24 does (earlier 5.x
    releases keep the first drawn).

    Two keywords of its own, which generate() hands to it: `graphs` (None: graphs where they
    serve, else eager steps; True: raise where they cannot; False: eager steps) and `on_token`,
    called with each step's new tokens [B] (on the host; not with beams, whose rows change
    places every step). Stream with `on_token`: transformers' generate (5.17 to 5.24 at least)
    does not pass its `streamer` to a custom decoding method. It puts the prompt into the
    streamer and never ends it, so a TextIteratorStreamer's reader would wait forever. A
    streamer that does arrive is used.

    The prompt's tokens that the cache does not hold yet are prefilled in chunks of the
    generation config's `prefill_chunk_size` (else PREFILL_CHUNK). generate() repeats each
    prompt once a beam (or a returned sequence): those copies are prefilled once and the
    cache's row then repeated, so they share its blocks and cost one prefill. Decode steps come
    from `GraphDecoder` where it serves (CUDA, the triton backend; left-padded rows too, their
    padding given to it as each row's start); beam search's reorder of the cache moves the
    rows in place, so the same graph goes on. Elsewhere, and after a failed recording (warned
    once), steps run eagerly, as generate's loop would. The cache then holds the prompt and
    every new token but the last (for beams: the running beams'), as after generate's own
    loop. Diverse (grouped) or constrained beam search, assisted decoding and other inputs
    raise ValueError: call generate without `custom_generate` for them."""
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
    beams = gc.num_beams > 1
    if beams and ((getattr(gc, "num_beam_groups", None) or 1) > 1 or getattr(gc, "constraints", None) or getattr(gc, "force_words_ids", None)):
        raise ValueError("graph_decoding's beam search is plain beam search: for diverse (grouped) or constrained beams call generate() without custom_generate")
    if beams and getattr(gc, "low_memory", False):
        raise ValueError("graph_decoding: low_memory beam search is not supported (nor is it by transformers' own beam search)")
    if beams and on_token is not None:
        raise ValueError("graph_decoding: on_token streams one sequence a row; beams change rows every step, so it cannot be used with num_beams > 1")
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
    copies = max(gc.num_beams, gc.num_return_sequences or 1)
    logits = _prefill_copies(model, cache, input_ids[:, done:], mask if padded else None, chunk, copies)
    start = start_offsets(mask.to(model.device), T) if padded else None  # (each row's padding; prefill checked the mask)
    decoder = graph_decoder(model, cache, graphs, start=start)
    step = _Steps(model, cache, decoder, mask if padded else None)
    if beams:
        return _beam_search(input_ids, logits, step, cache, logits_processor, stopping_criteria, gc)

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
        logits = step(tokens)
    if streamer is not None:
        streamer.end()
    if not gc.return_dict_in_generate:
        return input_ids
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw, **_cache_field(GenerateDecoderOnlyOutput, cache))


def _cache_field(output_class, cache) -> dict:
    """The output's cache keyword: `cache` on transformers that renamed it, else past_key_values."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(output_class)}
    return {"cache" if "cache" in fields else "past_key_values": cache}


def _prefill_copies(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, chunk: int, copies: int) -> torch.Tensor:
    """Prefill ids [B, T] (the prompt's tokens the cache does not hold yet; mask [B, N + T]
    or None) and return the last position's logits [B, V] in fp32. generate() repeats each
    prompt `copies` times in a row (beams, returned sequences): where each such group's rows
    are equal and the cache holds no row or one a group, one row a group is fed and the
    cache's rows are then repeated (sharing its blocks), not each copy."""
    B = ids.shape[0]
    held = cache.batch_size if cache.is_initialized else 0
    if copies > 1 and B % copies == 0 and held in (0, B // copies):
        groups = [ids.view(B // copies, copies, -1)] + ([mask.view(B // copies, copies, -1)] if mask is not None else [])
        if all(bool((g == g[:, :1]).all()) for g in groups):
            logits = prefill(model, cache, ids[::copies], chunk=chunk, all_logits=False, attention_mask=None if mask is None else mask[::copies])
            cache.batch_repeat_interleave(copies)
            return logits.repeat_interleave(copies, 0)
    if held not in (0, B):
        raise ValueError(f"graph_decoding: the cache holds {held} rows and generate() feeds {B}")
    logits = prefill(model, cache, ids, chunk=chunk, all_logits=False, attention_mask=mask)
    return logits.to(torch.float32, copy=True)  # (made in inference mode: a plain tensor for the processors)


class _Steps:
    """graph_decoding's decode steps: step(tokens [B]) feeds one token a row and returns the
    next logits [B, V] in fp32 (a copy): replayed by `decoder` where there is one, else an
    eager forward, with the growing mask and each row's positions for a left-padded batch."""

    def __init__(self, model, cache, decoder, mask: torch.Tensor | None):
        self.model, self.decoder, self.kwargs = model, decoder, cache_kwargs(model, cache)
        self.mask = mask
        self.positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)[:, -1:] if mask is not None else None  # each row's last

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens[:, None].to(self.model.device)
        if self.decoder is not None:
            return self.decoder.step(ids).to(torch.float32, copy=True)  # (a graph's buffer: the next replay overwrites it)
        step = {}
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
            self.positions = self.positions + 1
            step = dict(attention_mask=self.mask, position_ids=self.positions)
        return self.model(input_ids=ids, use_cache=True, **self.kwargs, **step).logits[:, -1].to(torch.float32, copy=True)


def _beam_search(input_ids: torch.Tensor, logits: torch.Tensor, step: _Steps, cache, logits_processor, stopping_criteria, gc):
    """Beam search over `step`, as transformers' own (5.x) does it: the same candidates,
    finished hypotheses, length penalty, early stopping, returned sequences and outputs.

    input_ids [B * K, T] hold each prompt K times (K = num_beams) and logits [B * K, V] the
    prefill's. Every step keeps the K best running continuations of each prompt (of 2K or
    more candidates, so that K survive those that stop) and the K best finished ones; the
    cache's rows then follow the running beams (`reorder_cache`, in place)."""
    K, R = gc.num_beams, gc.num_return_sequences or 1
    BK, T = input_ids.shape
    B, V, dev = BK // K, logits.shape[-1], input_ids.device
    eos = gc._eos_token_tensor
    pad = gc._pad_token_tensor
    lp, early, max_len = gc.length_penalty, gc.early_stopping, gc.max_length
    n_cand = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * K
    # what the sequences hold past their end: the pad token unless it is 0 or unset, then the
    # first EOS, or -1 without an EOS (as transformers fills its beams)
    fill = -1 if eos is None else int(pad) if pad is not None and int(pad) != 0 else int(eos[0])
    rows = torch.arange(B, device=dev)[:, None]
    first_k = torch.arange(n_cand, device=dev) < K  # the candidates a finished hypothesis may come from

    def pick(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # t [B, n, ...] -> t[b, idx[b, j]]
        return t[rows, idx]

    seqs = torch.full((B, K, max_len), fill, dtype=torch.long, device=dev)
    seqs[:, :, :T] = input_ids.view(B, K, T)
    origin = torch.full((B, K, max_len - T), -1, dtype=torch.int32, device=dev)  # each step's source row (flat)
    score = torch.full((B, K), -1e9, device=dev)
    score[:, 0] = 0.0  # (one live beam to start: the copies would pick the same tokens)
    done_seqs, done_origin = seqs.clone(), origin.clone()
    done_score = torch.full((B, K), -1e9, device=dev)
    done_flag = torch.zeros((B, K), dtype=torch.bool, device=dev)
    may_improve = torch.ones((B, 1), dtype=torch.bool, device=dev)
    scores = () if gc.return_dict_in_generate and gc.output_scores else None
    raw = () if gc.return_dict_in_generate and gc.output_logits else None
    cur = T
    while True:
        logp = logits_processor(seqs[:, :, :cur].reshape(BK, cur), torch.log_softmax(logits, dim=-1))
        if raw is not None:  # (both are this step's own tensors, not written after)
            raw += (logits,)
        if scores is not None:
            scores += (logp,)
        total = (logp.view(B, K, V) + score[:, :, None]).view(B, K * V)
        if gc.do_sample:  # n_cand draws without replacement, best first
            drawn = torch.multinomial(torch.softmax(total, dim=-1), num_samples=n_cand)
            cand_score, order = total.gather(1, drawn).sort(dim=-1, descending=True)
            cand = drawn.gather(1, order)
        else:
            cand_score, cand = total.topk(n_cand)
        src = cand // V
        cand_seqs, cand_origin = pick(seqs, src), pick(origin, src)
        cand_seqs[:, :, cur] = cand % V
        cand_origin[:, :, cur - T] = (src + rows * K).to(torch.int32)
        stops = stopping_criteria(cand_seqs[:, :, : cur + 1].reshape(B * n_cand, cur + 1), scores).view(B, n_cand)
        # the running beams: the best K candidates that did not stop
        live = cand_score - 1e9 * stops.float()
        keep = live.topk(K).indices
        seqs, score, origin = pick(cand_seqs, keep), pick(live, keep), pick(cand_origin, keep)
        # the finished hypotheses: the best K of those kept so far and this step's stopped top-K
        # candidates, scored by length; none is added once a prompt's are final
        ended = stops & first_k
        final = cand_score / (cur + 1 - T) ** lp
        final = final - 1e9 * (done_flag.all(-1, keepdim=True) & (early is True)).float()
        final = final - 1e9 * (~may_improve).float()
        final = final - 1e9 * (~ended).float()
        best = torch.cat([done_score, final], 1).topk(K).indices
        done_seqs = pick(torch.cat([done_seqs, cand_seqs], 1), best)
        done_score = pick(torch.cat([done_score, final], 1), best)
        done_origin = pick(torch.cat([done_origin, cand_origin], 1), best)
        done_flag = pick(torch.cat([done_flag, ended], 1), best)
        cache.reorder_cache(origin[:, :, cur - T].reshape(BK).long())
        cur += 1
        # can a running beam still beat a prompt's worst finished one? (transformers' heuristic:
        # at the present length, or the longest for early_stopping="never" with a positive penalty)
        length = (max_len if early == "never" and lp > 0.0 else cur) - T
        worst = torch.where(done_flag, done_score.min(1, keepdim=True).values, -1e9)
        may_improve = may_improve & (score[:, :1] / length**lp > worst).any(-1, keepdim=True)
        go = may_improve.any() & ~(done_flag.all() & (early is True)) & ~stops.all()
        if not bool(go):
            break
        logits = step(seqs[:, :, cur - 1].reshape(BK))

    seqs = done_seqs[:, :R].reshape(B * R, max_len)
    origin = done_origin[:, :R].reshape(B * R, max_len - T)
    new = int((origin >= 0).sum(1).max())  # the longest returned hypothesis's new tokens
    seqs, origin = seqs[:, : T + new], origin[:, :new]
    if not gc.return_dict_in_generate:
        return seqs
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

    return GenerateBeamDecoderOnlyOutput(sequences=seqs, sequences_scores=done_score[:, :R].reshape(B * R) if gc.output_scores else None,
                                         scores=scores, logits=raw, beam_indices=origin, **_cache_field(GenerateBeamDecoderOnlyOutput, cache))
