"""A multi-turn chat over one long-lived cache: only each new turn's tokens are prefilled.

`ChatSession` keeps the conversation, the token ids already in the cache and the cache
itself. A turn renders the whole conversation with the tokenizer's chat template, keeps
the longest prefix the cache already holds (cropping the cache if the template tokenizes
the history differently), prefills the rest in chunks and streams the answer. An
interrupted turn (Ctrl-C) keeps what was generated and the cache stays consistent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .generate import GenerationStats, prefill
from .integrations.transformers import cache_kwargs
from .persist import common_prefix


@dataclass
class SamplingConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    @classmethod
    def for_model(cls, model, **given) -> SamplingConfig:
        """The model's own sampling where its generation config sets it (do_sample with its
        temperature and top_p; max_new_tokens), else greedy, 256 new tokens; `given` (not None)
        overrides."""
        gc = getattr(model, "generation_config", None)
        own = gc.to_diff_dict() if gc is not None else {}
        found = {}
        if own.get("do_sample"):
            found.update(temperature=gc.temperature if gc.temperature is not None else 1.0, top_p=gc.top_p if gc.top_p is not None else 1.0)
        if own.get("max_new_tokens"):
            found["max_new_tokens"] = own["max_new_tokens"]
        return cls(**{**found, **{k: v for k, v in given.items() if v is not None}})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> int:
    """Next token from logits [V]: greedy at temperature 0, else nucleus sampling."""
    if cfg.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < cfg.top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


LOOP_TOKENS = 24  # a reply whose last tokens repeat one span for at least this many tokens (and 3 times) has looped


def repeating(ids: list[int], longest: int = 64) -> bool:
    """Whether `ids` ends in one span of 1 to `longest` tokens repeated at least 3 times and over
    at least LOOP_TOKENS tokens: small models at low temperature fall into such loops and would
    repeat until max_new_tokens."""
    for n in range(1, longest + 1):
        times = max(3, -(-LOOP_TOKENS // n))
        if len(ids) < n * times:
            continue
        span = ids[-n:]
        if all(ids[-(i + 1) * n : len(ids) - i * n] == span for i in range(1, times)):
            return True
    return False


@dataclass
class ChatSession:
    """model, tokenizer and a cache (any transformers Cache; LongCtxCache for paged KV)."""

    model: object
    tokenizer: object
    cache: object
    system: str | None = None
    chunk: int = 512
    max_context: int | None = None
    graphs: bool | None = None  # decode from CUDA graphs: None where they serve, True always, False never (`longctx.graphs`)
    messages: list[dict] = field(default_factory=list)
    cached_ids: list[int] = field(default_factory=list)  # exactly the tokens the cache holds
    last: GenerationStats = field(default_factory=GenerationStats)
    _decoder: object = field(default=None, init=False, repr=False)  # a GraphDecoder once a turn found one serves

    def __post_init__(self) -> None:
        if self.system:
            self.messages.append({"role": "system", "content": self.system})

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty the cache."""
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.cache.reset()
        self.cached_ids = []
        self.last = GenerationStats()  # (/stats shows no figures of a turn that is gone)

    def save_kv(self, path) -> int:
        """Save the cache, the tokens it holds and the conversation to `path` (a LongCtxCache's
        file, `longctx.persist`); returns its bytes. `load_kv` continues from it."""
        if not hasattr(self.cache, "save"):
            raise ValueError(f"this chat's cache ({type(self.cache).__name__}) cannot be saved; a LongCtxCache can")
        if not self.cached_ids:
            raise ValueError("nothing to save yet: the cache is empty")
        return self.cache.save(path, [self.cached_ids], extra={"messages": self.messages})

    @classmethod
    def load_kv(cls, model, tokenizer, path, config=None, **kw) -> ChatSession:
        """A session continuing the conversation saved at `path`: its messages, and its cache
        loaded (`LongCtxCache.load`, `config` for its capacity), so that only new turns are
        prefilled. A file from another model or damaged raises CacheFileError."""
        from .integrations.transformers import LongCtxCache
        from .persist import CacheFileError, read_info

        info = read_info(path)
        messages = info.extra.get("messages")
        if info.rows != 1 or not isinstance(messages, list):
            raise CacheFileError(f"{path} holds a cache but no chat ({info.rows} row(s), no messages): save one with longctx chat --save-kv")
        cache, ids = LongCtxCache.load(model, path, config)
        session = cls(model, tokenizer, cache, messages=list(messages), cached_ids=ids[0].tolist(), **kw)
        return session

    def _render(self, generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=generation_prompt, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding on some transformers releases
            ids = ids["input_ids"]
        return list(ids)

    def _sync_prefix(self, full: list[int]) -> list[int]:
        """Crop the cache to the part of `full` it already holds; return the rest."""
        keep = common_prefix(self.cached_ids, full)
        if keep == len(full):  # always feed at least one token to get logits
            keep -= 1
        if keep < len(self.cached_ids):
            self.cache.crop(keep)
            self.cached_ids = self.cached_ids[:keep]
        return full[keep:]

    @torch.inference_mode()
    def preload(self, on_prefill: Callable[[int, int], None] | None = None, on_context: Callable[[int], None] | None = None) -> int:
        """Prefill the conversation so far (e.g. a long system document) before any
        question, so the first turn only prefills its own tokens. Returns tokens fed.

        on_context(tokens) is told the context's length before anything is prefilled."""
        new = self._sync_prefix(self._render(generation_prompt=False))
        context = len(self.cached_ids) + len(new)
        if self.max_context is not None and context > self.max_context:
            raise ValueError(
                f"the system prompt and document are {context:,} tokens; --max-context is "
                f"{self.max_context:,}. Raise --max-context (longctx plan shows what fits) or shorten the document"
            )
        if on_context is not None:
            on_context(context)
        t0 = time.perf_counter()
        self._feed(new, on_prefill)
        self.last = GenerationStats(prompt_tokens=len(new), prefill_s=time.perf_counter() - t0)
        return len(new)

    def _feed(self, new: list[int], on_prefill: Callable[[int, int], None] | None) -> torch.Tensor:
        """Prefill `new` after the cached tokens; returns the last logits. cached_ids
        follows the chunks that completed, also when interrupted: a chunk cut short leaves
        the cache at whole steps, and the next turn crops it to the prefix both agree on."""
        base, fed = list(self.cached_ids), [0]

        def progress(done: int, _logits) -> None:
            fed[0] = done
            if on_prefill is not None:
                on_prefill(done, len(new))

        try:
            return prefill(self.model, self.cache, torch.tensor([new], device=self.model.device), chunk=self.chunk, on_chunk=progress, all_logits=False)
        finally:
            self.cached_ids = base + new[: fed[0]]

    @torch.inference_mode()
    def send(
        self,
        text: str,
        sampling: SamplingConfig | None = None,
        on_token: Callable[[str], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        generator: torch.Generator | None = None,
    ) -> str:
        """Add a user turn, stream the reply's text pieces to on_token, return the reply.

        on_prefill(tokens_done, tokens_total) reports prefill progress.
        """
        sampling = sampling or SamplingConfig()
        self.messages.append({"role": "user", "content": text})
        new = self._sync_prefix(self._render())
        if self.max_context is not None and len(self.cached_ids) + len(new) + sampling.max_new_tokens > self.max_context:
            self.messages.pop()
            raise ValueError(
                f"this turn needs {len(self.cached_ids) + len(new) + sampling.max_new_tokens} tokens of context "
                f"(history {len(self.cached_ids)}, new {len(new)}, answer up to {sampling.max_new_tokens}); "
                f"--max-context is {self.max_context}. /reset, or raise --max-context"
            )
        stats = GenerationStats(prompt_tokens=len(new))
        t0 = time.perf_counter()
        logits = self._feed(new, on_prefill)
        stats.prefill_s = time.perf_counter() - t0
        eos = self.tokenizer.eos_token_id
        reply_ids: list[int] = []
        shown = ""  # text streamed so far: decode the whole reply, emit the new suffix
        kw = cache_kwargs(self.model, self.cache)
        if self._decoder is None:  # (one for the session: it records anew when a turn changed the cache)
            from .graphs import graph_decoder

            self._decoder = graph_decoder(self.model, self.cache, self.graphs)
        t0 = time.perf_counter()
        try:
            for _ in range(sampling.max_new_tokens):
                tok = sample(logits[0], sampling, generator)
                if tok == eos:
                    break
                if repeating(reply_ids + [tok]):  # (what was streamed stays; the loop ends before this token)
                    stats.stopped = "the answer was repeating itself"
                    break
                reply_ids.append(tok)
                if on_token is not None:
                    text_now = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
                    if not text_now.endswith("\ufffd"):  # wait for a whole UTF-8 character
                        on_token(text_now[len(shown):])
                        shown = text_now
                ids = torch.tensor([[tok]], device=self.model.device)
                if self._decoder is not None:
                    logits = self._decoder.step(ids).float()
                else:
                    logits = self.model(input_ids=ids, use_cache=True, **kw).logits[:, -1].float()
                self.cached_ids.append(tok)
        finally:
            stats.decode_s = time.perf_counter() - t0
            stats.new_tokens = len(reply_ids)
            self.last = stats
            reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": reply})
        return reply

    def transcript_markdown(self) -> str:
        lines = ["# longctx chat transcript", ""]
        for m in self.messages:
            lines += [f"**{m['role']}**", "", m["content"], ""]
        return "\n".join(lines)
