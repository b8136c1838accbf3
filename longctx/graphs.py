"""Decode steps replayed from CUDA graphs: one graph launch a token instead of the model's
few thousand kernel launches and the Python around them.

An eager decode step of a 7B-class model is bound by the host at any context an H200 or a
consumer card holds (docs/benchmarks.md: 60 ms a token with DynamicCache + SDPA at 128k on an H200,
against 8.3 from graphs). `GraphDecoder` records one step of the model over a `LongCtxCache` into a CUDA graph
and replays it while nothing but the step's position changes: the token ids, the position
ids and the tail's write slot and length live on the device, and the graph advances them
itself. When a block seals, once every block_size tokens, the decoder seals between two
replays (eagerly, as an eager step would): the seal writes the new column into a table with
room and the block count on the device (the cache's `DeviceStep`), which the decode kernel
loads, so the same graph goes on. A new graph is recorded only when that table is full
(after GRAPH_ROOM's blocks) or something else changed the cache.

What it takes: a CUDA model, a LongCtxCache whose attention runs on the triton backend (the
decode kernel reads the tail's length from the device), and a prefilled cache. Left-padded
rows take their padding as `start` (each row's first attended position) instead of an
attention mask: a mask is read on the host, which a replay cannot do; the steps' positions
then skip each row's padding, as generate's do. `GraphDecoder.unsupported` names what is
missing; `greedy`, `ChatSession` and `graph_decoding` fall back to eager steps then.
"""

from __future__ import annotations

import inspect
import warnings

import torch

from .integrations.transformers import LongCtxCache, cache_kwargs
from .ops.backend import resolve_backend


class GraphDecoder:
    """Decode steps of `model` over `cache` (a prefilled LongCtxCache) from CUDA graphs.

    step(ids [B, 1]) feeds one token a row and returns the next position's logits [B, V]:
    a buffer of the graph, valid until the next step (copy what you keep). `next_ids` [B, 1]
    holds their argmax (the greedy choice), computed inside the graph.

    A graph is recorded at the first step, again when the cache's graph table is full (its
    seals went on in place until then: every GRAPH_ROOM blocks), and whenever the cache was
    changed by something else (an eager step, a crop, a reset): the decoder checks the tail
    lengths, the rows and the tensors the graph holds before each replay. Recording costs
    about one eager step; the others cost a graph launch, and a seal its eager work.

    start (int [B], or None): each row's first attended position in the cache, for a
    left-padded batch (the count of its leading padding tokens). The steps take no attention
    mask; a row's positions are its tokens after the padding (generate's `position_ids`).

    strict=False: where recording fails (a layer of the model that cannot be captured, such
    as a weight format whose kernels wait on the host), warn once and take eager steps from
    then on; strict=True raises.
    """

    def __init__(self, model, cache: LongCtxCache, strict: bool = True, start: torch.Tensor | None = None):
        why = self.unsupported(model, cache)
        if why:
            raise ValueError(f"GraphDecoder: {why}")
        self.model, self.cache, self.paged = model, cache, cache.paged
        device, B = model.device, cache.paged.batch_size
        self.start = None  # int32 [B] on the device, None where no row is padded
        if start is not None:
            start = torch.as_tensor(start)
            n = cache.paged.seq_len()
            if start.shape != (B,) or start.dtype.is_floating_point or start.dtype == torch.bool or bool((start < 0).any()) or bool((start > n).any()):
                raise ValueError(f"GraphDecoder: start must be integers [{B}] in 0..{n} (each row's padding), got {start.dtype} {tuple(start.shape)}: {start.tolist()}")
            if bool((start > 0).any()):
                self.start = start.to(device=device, dtype=torch.int32, copy=True)
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)  # each row's, past its padding
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)  # the cache's, all rows alike
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.length = torch.zeros(1, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None
        self.next_ids: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.kwargs = dict(cache_kwargs(model, cache), use_cache=True)
        params = inspect.signature(model.forward).parameters
        if "logits_to_keep" in params:
            self.kwargs["logits_to_keep"] = 1
        self._cache_position = "cache_position" in params  # (older transformers read it besides position_ids)
        self._state = None  # what the graph's next replay expects of the cache (`_current`)
        self.strict = strict
        self.failed: str | None = None  # why recording failed (strict=False: eager steps since)
        self.recorded = 0  # graphs recorded so far
        self.replayed = 0

    @staticmethod
    def unsupported(model, cache, empty_ok: bool = False) -> str | None:
        """Why a GraphDecoder cannot serve `model` and `cache`, or None (empty_ok: the cache
        may be still empty, as before a prefill)."""
        if not isinstance(cache, LongCtxCache):
            return f"CUDA-graph decoding needs a LongCtxCache, got {type(cache).__name__}"
        if not torch.cuda.is_available() or getattr(model, "device", torch.device("cpu")).type != "cuda":
            return "CUDA-graph decoding needs the model on a CUDA device"
        paged = cache.paged
        if paged.layer_devices is not None and len(set(paged.layer_devices)) > 1:
            return ("a model split over several devices decodes eagerly: accelerate's hooks move the hidden states from card to card "
                    "inside the forward, and a CUDA graph records the stream of one device; a graph a card needs the forward cut "
                    "at each hop, which longctx does not do yet")
        try:
            probe = torch.empty(0, device=model.device)
            backend = resolve_backend(cache.kv_config.backend, probe, paged.head_dim)
        except Exception as e:  # (a backend that cannot serve: the eager path raises its own error)
            return str(e)
        if backend != "triton":
            return f"CUDA-graph decoding needs the triton backend (the kernel reads the tail's length on the device), this cache runs {backend!r}"
        if paged.host is not None:
            return ("a cache with a host tier decodes eagerly: its steps copy the host pages across the link on a second stream, "
                    "ordered by events from step to step, which a replayed graph cannot follow; at the contexts a host tier serves "
                    "the copies take hundreds of ms a step, and the launches a graph saves a few")
        if model.config._attn_implementation != "longctx":
            return f"the model's attention is {model.config._attn_implementation!r}, not LongCtxCache's 'longctx'"
        if not empty_ok and (not paged.initialized or paged.batch_size == 0):
            return "the cache is empty: prefill the prompt first"
        return None

    def _current(self) -> tuple:
        """What the graph's next replay relies on: the tail lengths and rows, and (by
        identity) the tensors whose addresses it holds: the graph table (a seal writes into
        it, or drops it when full; a reorder moves its rows in place, a change of the row count
        drops it), the tails, the sinks and the pools (replaced when they grow)."""
        paged = self.paged
        table = paged.device_step.table if paged.device_step is not None else None
        pool = next(iter(paged.pages[0].tensors().values()))
        seg = paged.segments[0]
        return (tuple(paged.tail_len), paged.batch_size), (table, seg.tail_k, seg.sink_k, pool)

    def _stale(self) -> bool:
        if self.graph is None or self._state is None:
            return True
        (counts, tensors), (now_counts, now_tensors) = self._state, self._current()
        return counts != now_counts or any(a is not b for a, b in zip(tensors, now_tensors))

    def _forward(self) -> None:
        kw = dict(self.kwargs)
        if self._cache_position:
            kw["cache_position"] = self.cache_position
        out = self.model(input_ids=self.ids, position_ids=self.positions, **kw)
        self.logits = out.logits[:, -1]
        self.next_ids = self.logits.argmax(-1, keepdim=True)
        self.slot += 1
        self.length += 1
        self.positions += 1
        self.cache_position += 1

    def _set_counters(self) -> None:
        paged = self.paged
        t, n = paged.tail_len[0], paged.seq_len()
        self.slot.fill_(t)
        self.length.fill_(t + 1)
        self.cache_position.fill_(n)
        self.positions.fill_(n)
        if self.start is not None:
            self.positions.sub_(self.start[:, None])

    def _eager(self, ids: torch.Tensor) -> torch.Tensor:
        """One eager step (after a failed recording): the mask and positions a padded batch needs."""
        kw = dict(self.kwargs)
        if self.start is not None:
            n = self.paged.seq_len()
            start = self.start.long()[:, None]
            kw["attention_mask"] = (torch.arange(n + 1, device=start.device)[None, :] >= start).long()
            kw["position_ids"] = n - start
        return self.model(input_ids=ids.to(self.ids.device), **kw).logits[:, -1]

    def _record(self) -> None:
        """A new graph of one step at the cache's present tables and tail."""
        from .ops.paged_attention.tuning import tiny_codes_exact

        tiny_codes_exact(self.model.device)  # (its probe waits for its result: not inside a capture)
        self.graph = None  # (each graph records into a pool of its own, given back with it: on torch
        # 2.11, capture_begin with a handle from graph_pool_handle() failed an allocator assert)
        paged = self.paged
        if self.recorded == 0:  # warm up on a side stream, as CUDA graphs ask: lazy inits, compiles
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), paged.static_step(self.slot, self.length, self.start):
                self._set_counters()
                self._forward()  # (writes the step's own slot, which the replay writes again)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with paged.static_step(self.slot, self.length, self.start):
            with torch.cuda.graph(graph):
                self._forward()
        self.graph = graph
        self.recorded += 1
        self._set_counters()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, 1] (one token a row); returns the next logits [B, V] (see the class)."""
        paged = self.paged
        if ids.shape != self.ids.shape:
            raise ValueError(f"GraphDecoder.step: ids must be {tuple(self.ids.shape)} (one token a row), got {tuple(ids.shape)}")
        if len(set(paged.tail_len)) != 1:  # a step interrupted mid-way: drop its tokens, as append does
            paged.tail_len = [min(paged.tail_len)] * paged.num_layers
        paged.check_room(1)
        if paged.tail_len[0] >= paged.block_size:
            fresh = not self._stale()
            paged.seal()
            if fresh and self.failed is None:  # the graph outlives its own seals while its tensors stay
                now = self._current()
                if all(a is b for a, b in zip(self._state[1], now[1])):
                    self._set_counters()
                    self._state = now
        if self.failed is not None:
            return self._eager(ids)
        self.ids.copy_(ids, non_blocking=True)
        if self._stale():
            try:
                self._record()
            except Exception as e:
                if self.strict:
                    raise
                self.failed, self.graph = f"{type(e).__name__}: {e}", None
                warnings.warn(f"CUDA-graph decoding failed to record a step ({self.failed}); decoding eagerly from here", stacklevel=2)
                return self.step(ids)
        t = paged.tail_len[0]
        self._state = None  # (interrupted between the replay and the host's count: record anew)
        self.graph.replay()
        paged.tail_len = [t + 1] * paged.num_layers
        self._state = self._current()
        self.replayed += 1
        return self.logits


def graph_decoder(model, cache, graphs: bool | None, start: torch.Tensor | None = None) -> GraphDecoder | None:
    """A GraphDecoder for a prefilled `cache` (rows padded by `start`, as GraphDecoder takes
    it), by the `graphs` option the decode loops take: None where one can serve (else None:
    eager steps), True always (ValueError naming what is missing), False never."""
    if graphs is False:
        return None
    why = GraphDecoder.unsupported(model, cache)
    if why is None:
        return GraphDecoder(model, cache, strict=bool(graphs), start=start)
    if graphs:
        raise ValueError(f"graphs=True: {why}")
    return None
