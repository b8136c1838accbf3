"""Hugging Face transformers integration: `LongCtxCache` and the "longctx" attention.

`LongCtxCache(model, KVConfig(...))` builds a `PagedKVCache` for the model's decoder,
registers the "longctx" attention in both `AttentionInterface` and `AttentionMaskInterface`
(without the mask function transformers silently drops padding masks) and switches the
model to it. Pass the cache as `cache=` (releases before that rename: `past_key_values=`) to
`generate()` or `model(...)`; `cache_kwargs(model, cache)` builds the right keyword.

How attention finds the pages: the model calls `cache.update(k, v, layer_idx)` right
before its attention function. `update` appends k/v to the pages and records (k, cache,
layer); the "longctx" attention function receives that same k object and reads the pages.
With nothing recorded (another cache, or none) it attends densely, so a model switched to
"longctx" still works with `DynamicCache` or `use_cache=False`. A recorded hand-off that the
same layer's attention does not match (the model changed the key after `update`) raises:
attending the new chunk alone would silently drop the cache.

With any other attention implementation, `update` returns the dequantized K/V (slow:
the whole cache is expanded every step) and warns once.
"""

from __future__ import annotations

import inspect
import threading
import warnings

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..cache import MemoryReport, PagedKVCache
from ..config import KVConfig
from ..errors import UnsupportedModelError
from ..ops.paged_attention import dense_attention

ATTN_NAME = "longctx"
_pending = threading.local()  # .entry = (key tensor returned by update, PagedKVCache, layer)
_mask_memo = threading.local()  # .memo = (mask tensor, kv_len, start offsets)


# ---------------------------------------------------------------------- attention + mask
def longctx_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask function for "longctx": the 2D padding mask [B, kv_length] (bool), or None when
    nothing is padded. Causality is applied by the attention itself."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def start_offsets(mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """First attended position of each row from a 2D left-padding mask [B, >=kv_len]."""
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(
            f"longctx attention takes a 2D padding mask [batch, kv_len]; got a {mask.dim()}D mask "
            f"{tuple(mask.shape)}. Custom 4D masks are not supported."
        )
    memo = getattr(_mask_memo, "memo", None)
    if memo is not None and memo[0] is mask and memo[1] == kv_len:
        return memo[2]
    m = mask[:, -kv_len:].bool()
    if m.shape[1] < kv_len:  # mask shorter than the cache: the missing prefix is attended
        m = torch.cat([m.new_ones(m.shape[0], kv_len - m.shape[1]), m], 1)
    has_any = m.any(1)
    first = torch.where(has_any, m.int().argmax(1), torch.full_like(has_any, kv_len, dtype=torch.long))
    expected = torch.arange(kv_len, device=m.device)[None, :] >= first[:, None]
    if not torch.equal(m, expected):
        raise ValueError("longctx attention supports left padding only: a row of the attention mask has a gap after its first token")
    first = first.to(torch.int32)
    _mask_memo.memo = (mask, kv_len, first)
    return first


def longctx_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry: query [B, H_q, C, D] -> ([B, C, H_q, D], None)."""
    if dropout:
        raise ValueError(f"longctx attention is for inference: got dropout={dropout} (call model.eval())")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"longctx attention does not support {name!r} (attention logit soft-capping / learned sinks)")
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError("longctx attention pages full-attention layers only; this layer uses a sliding window")
    entry = getattr(_pending, "entry", None)
    _pending.entry = None
    if entry is not None and entry[0] is not key:
        layer = getattr(module, "layer_idx", None)
        if layer is None or layer == entry[2]:
            raise RuntimeError(
                f"longctx attention of layer {entry[2]} got another key than LongCtxCache.update returned "
                f"({tuple(key.shape)} against {tuple(entry[0].shape)}): the model changes K between the cache and its attention, "
                "which the paged cache cannot follow; use another attn_implementation with LongCtxCache(..., attach=False)")
        entry = None  # (left by a forward that stopped between update and attention: not this one's)
    if entry is not None:
        paged, layer = entry[1], entry[2]
        start = start_offsets(attention_mask, paged.seq_len(layer))
        out, _ = paged.attend(layer, query, start, scaling, return_lse=False)
    else:
        start = start_offsets(attention_mask, key.shape[2])
        out, _ = dense_attention(query, key, value, start, scaling, return_lse=False)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "longctx" in AttentionInterface and AttentionMaskInterface (idempotent)."""
    AttentionInterface.register(ATTN_NAME, longctx_attention)
    AttentionMaskInterface.register(ATTN_NAME, longctx_mask)


register()


# ---------------------------------------------------------------------- model checks
def decoder_shape(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    tc = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    return tc.num_hidden_layers, kv_heads, head_dim


def check_supported(model_config) -> None:
    """Raise UnsupportedModelError unless every decoder layer is plain full attention."""
    tc = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    name = getattr(tc, "model_type", type(tc).__name__)
    if getattr(model_config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported; longctx pages decoder-only models")
    layer_types = getattr(tc, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedModelError(
                f"{name} has {', '.join(other)} layers; longctx pages full-attention layers only "
                "(sliding-window and hybrid models keep their stock cache)"
            )
    elif getattr(tc, "sliding_window", None) is not None and getattr(tc, "use_sliding_window", True):
        raise UnsupportedModelError(
            f"{name} uses sliding-window attention (window {tc.sliding_window}); longctx pages full-attention layers only"
        )
    if getattr(tc, "attn_logit_softcapping", None):
        raise UnsupportedModelError(f"{name} soft-caps attention logits; the longctx attention does not")
    if not all(hasattr(tc, a) for a in ("num_hidden_layers", "num_attention_heads")):
        raise UnsupportedModelError(f"{name}: no num_hidden_layers/num_attention_heads in its config")


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer's attention runs on: where accelerate's hooks execute it
    (a model loaded with a device_map; its weights may sit elsewhere, offloaded), else where its
    weights are. The layers are the attention modules (a class named ...Attention) that carry
    a `layer_idx`; a model without them is taken to be on `model.device`."""
    found: dict[int, torch.device] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or not type(module).__name__.endswith("Attention") or idx in found:
            continue
        device = None
        parts = name.split(".")
        for depth in range(len(parts), -1, -1):  # the nearest hook of the module or an ancestor
            device = _hook_device(modules.get(".".join(parts[:depth])))
            if device is not None:
                break
        if device is None:
            param = next(module.parameters(), None)
            device = param.device if param is not None else model.device
        found[idx] = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    layers = decoder_shape(model.config)[0]
    if sorted(found) != list(range(layers)):
        return [model.device] * layers
    return [found[i] for i in range(layers)]


def _hook_device(module):
    """The execution device of accelerate's hook on `module`, or None."""
    hook = getattr(module, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return device
    return None


def cache_kwarg_name(model) -> str:
    """'cache' on transformers releases that renamed it, else 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{'cache': cache} or {'past_key_values': cache}, whichever this transformers takes."""
    return {cache_kwarg_name(model): cache}


# ---------------------------------------------------------------------- the Cache
class LongCtxLayer(CacheLayerMixin):
    """One decoder layer's face of the shared PagedKVCache; the cache-level methods of
    LongCtxCache do the work (one block table serves every layer)."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, paged: PagedKVCache, layer_idx: int):
        # CacheLayerMixin.__init__ would set `is_initialized` as a plain attribute.
        self.paged, self.layer_idx = paged, layer_idx
        self.keys = self.values = None

    @property
    def is_initialized(self) -> bool:
        return self.paged.initialized

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("LongCtxLayer.update is driven by LongCtxCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.paged.seq_len() + query_length, 0

    def get_seq_length(self) -> int:
        return self.paged.seq_len()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass  # LongCtxCache.reset resets the shared tables once

    def reorder_cache(self, beam_idx) -> None:
        pass  # LongCtxCache.reorder_cache permutes the shared tables once

    def crop(self, tokens_to_remove: int) -> None:
        pass


class LongCtxCache(Cache):
    """A transformers `Cache` backed by a paged, quantized `PagedKVCache`.

    model:  a decoder-only transformers model with full attention in every layer.
    config: a KVConfig (default: int4, 64-token blocks, one bf16 sink block).
    attach: switch the model to the "longctx" attention now (default True). `detach()`
            restores the implementation it had.
    """

    def __init__(self, model, config: KVConfig | None = None, *, attach: bool = True):
        check_supported(model.config)
        self.kv_config = config or KVConfig()
        num_layers, kv_heads, head_dim = decoder_shape(model.config)
        devices = layer_devices(model)  # (a model split over devices: each layer's pages on its own)
        split = len(set(devices)) > 1
        self.paged = PagedKVCache(self.kv_config, num_layers, kv_heads, head_dim, devices=devices if split else None)
        super().__init__(layers=[LongCtxLayer(self.paged, i) for i in range(num_layers)])
        self._model = model
        self._previous_impl = None
        self._warned_dense = False
        if attach:
            self.attach()

    # -- attention selection
    def attach(self) -> None:
        register()
        current = self._model.config._attn_implementation
        if current != ATTN_NAME:
            self._previous_impl = current
            self._model.set_attn_implementation(ATTN_NAME)
            if self._model.config._attn_implementation != ATTN_NAME:
                raise UnsupportedModelError(
                    f"{type(self._model).__name__} refused attn_implementation={ATTN_NAME!r}; "
                    "it does not dispatch attention through AttentionInterface"
                )

    def detach(self) -> None:
        """Give the model back the attention implementation it had before `attach`."""
        if self._previous_impl is not None:
            self._model.set_attn_implementation(self._previous_impl)
            self._previous_impl = None

    # -- Cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.paged.append(layer_idx, key_states, value_states)
        if self._model.config._attn_implementation == ATTN_NAME:
            _pending.entry = (key_states, self.paged, layer_idx)
            return key_states, value_states
        if not self._warned_dense:
            warnings.warn(
                f"LongCtxCache with attn_implementation={self._model.config._attn_implementation!r}: every step "
                "dequantizes the whole cache for that attention. Use attn_implementation='longctx' (LongCtxCache "
                "sets it unless attach=False) to read the pages directly.",
                stacklevel=2,
            )
            self._warned_dense = True
        return self.paged.dense(layer_idx, dtype=key_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.paged.seq_len()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.paged.seq_len() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        self.paged.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows become rows[beam_idx] (flat global indices). Permutes block
        tables and copies tails only; sealed blocks are shared, never copied."""
        self.paged.reorder(beam_idx)

    def crop(self, max_length: int) -> None:
        """Negative: remove that many tokens. Otherwise keep the first `max_length`."""
        seq = self.paged.seq_len()
        self.paged.crop(seq + max_length if max_length < 0 else max_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.paged.select_rows(torch.arange(self.paged.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.paged.select_rows(indices)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.paged.initialized

    @property
    def batch_size(self) -> int:
        return self.paged.batch_size if self.paged.initialized else -1

    # -- longctx extras
    def memory_report(self) -> MemoryReport:
        return self.paged.memory_report()

    def save(self, path, token_ids, extra: dict | None = None) -> int:
        """Write the cache and the token ids it holds (int [rows, tokens], or one row's list) to
        `path`, a safetensors file (`longctx.persist`); returns its bytes. Between forwards.
        `extra`: plain JSON values kept in the header (`longctx.persist.read_info(path).extra`)."""
        from ..persist import save

        return save(self.paged, path, token_ids, model=self._model, extra=extra)

    @classmethod
    def load(cls, model, path, config: KVConfig | None = None, *, attach: bool = True) -> tuple[LongCtxCache, torch.Tensor]:
        """(cache, token ids) from a file `save` wrote for this `model`, on the model's device.
        `config`: the file's format with other capacity fields (max_blocks, host_blocks for a
        host tier that takes the oldest pages, stage_blocks, backend); default the file's, with
        no cap. A file from another model or version, or damaged, raises CacheFileError."""
        from ..cache import DTYPES
        from ..persist import check_model, load_config, load_into, read_info

        info = read_info(path)
        check_model(info, model)
        cfg = load_config(info, config)
        dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else model.dtype
        if dtype not in DTYPES.values():
            dtype = DTYPES[info.dtype] if info.dtype in DTYPES else torch.bfloat16
        cache = cls(model, cfg, attach=attach)
        try:
            ids = load_into(cache.paged, info, model.device, dtype)
        except BaseException:
            cache.detach()
            raise
        return cache, ids

    def __repr__(self) -> str:
        return f"LongCtxCache({self.kv_config.describe()}, layers={self.paged.num_layers}, tokens={self.paged.seq_len()})"


__all__ = ["LongCtxCache", "cache_kwargs", "cache_kwarg_name", "check_supported", "layer_devices", "longctx_attention", "register"]
