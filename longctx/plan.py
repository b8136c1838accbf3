"""How long a context fits: weights, KV bytes per token, activations and reserves on one GPU
or several.

`plan(model, gpu_gib, ...)` -> `Plan` with one `PlanRow` per KV format. The KV bytes come
from `kv_bytes`, the same arithmetic as `memory_report` (sinks, sealed blocks, the tail; a
test holds the two equal). Everything else is an estimate, documented term by term in
`Budget`; `longctx plan` renders it. The catalog is `longctx/configs/{models,gpus}.yaml`.

Several cards (`gpus`): the model is split by whole decoder layers, as accelerate's device_map
places it: the embeddings on the first card, the final norm and LM head on the last, and each
layer's weights and KV on the card that runs it. Every card holds its layers' pages of every
token, so a context fits when it fits each card; `split_layers` gives each card as many layers
as that allows, which balances the KV (not the weights, as transformers' device_map="auto"
does). `longctx chat --device-map auto` loads a model with that split.
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from .config import KVConfig, bits_format
from .errors import LongCtxError, ModelNotFoundError
from .quant import layer_page_bytes

GIB = 1 << 30
RUNTIME_OVERHEAD = 768 << 20  # CUDA context, cuBLAS/cuDNN workspaces, allocator bookkeeping
FRAGMENTATION = 0.05  # share of the budget kept free for the caching allocator's slack
# pinned host-to-device GB/s (10^9 bytes) a x16 link of each PCIe generation gives in practice
# (about 80 % of its raw rate); a catalog card with fewer lanes gets its share
PCIE_GBPS = {3: 12.0, 4: 25.0, 5: 50.0}
DEFAULT_PCIE = 4  # a budget without a catalog card (--gpu-mem)


class UnknownNameError(LongCtxError, ValueError):
    """A model or GPU name that is not in the catalog (the message suggests close matches)."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    max_context: int | None = None
    hub: str | None = None

    def param_count(self) -> int:
        """Parameters of a Llama-style decoder (RMSNorm, gated MLP), from the shape alone."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        embed = self.vocab * self.hidden
        return self.layers * per_layer + self.hidden + embed * (1 if self.tied else 2)

    def embedding_params(self) -> int:
        """Embedding and LM head (kept 16-bit by bitsandbytes quantization)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)


@functools.cache
def _catalog(kind: str) -> dict:
    import yaml

    text = resources.files("longctx").joinpath(f"configs/{kind}.yaml").read_text()
    return yaml.safe_load(text)


def catalog_models() -> dict:
    return _catalog("models")


def catalog_gpus() -> dict:
    return _catalog("gpus")


def _unknown(what: str, name: str, choices) -> UnknownNameError:
    close = difflib.get_close_matches(name.lower(), list(choices), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(choices))}"
    return UnknownNameError(f"unknown {what} {name!r}{hint}")


def model_shape(name: str) -> ModelShape:
    """A catalog name, a local directory with config.json, a .gguf file, or a hub id (needs the network)."""
    models = catalog_models()
    if name.lower() in models:
        return ModelShape(name=name.lower(), **models[name.lower()])
    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelNotFoundError(f"{path} has no config.json")
        return shape_from_config(json.loads(cfg_file.read_text()), name=str(path))
    if path.suffix == ".gguf":
        from .gguf_files import gguf_shape_config

        if not path.is_file():
            raise ModelNotFoundError(f"no GGUF file at {path}")
        return shape_from_config(gguf_shape_config(path), name=path.name)
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith((".json", ".gguf", ".safetensors"))
    if looks_like_path:
        raise ModelNotFoundError(f"no model directory at {name!r} (plan needs a directory with config.json)")
    if "/" not in name:  # not a hub id: most likely a catalog name with a typo
        raise _unknown("model", name, models)
    from .models import hub_kwargs

    hub = hub_kwargs(name)  # (fails fast where the hub is unreachable and the local cache holds nothing)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(name, **hub).to_dict()
    except Exception as e:  # offline, gated, or no such repo
        raise ModelNotFoundError(f"cannot read the config of {name!r} from the hub ({type(e).__name__}); "
                                 f"use a catalog name ({', '.join(sorted(models)[:4])}, ...) or a local directory") from None
    return shape_from_config(cfg, name=name)


def shape_from_config(cfg: dict, name: str = "") -> ModelShape:
    text = cfg.get("text_config") or cfg
    heads = text["num_attention_heads"]
    return ModelShape(
        name=name,
        layers=text["num_hidden_layers"],
        hidden=text["hidden_size"],
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate=text["intermediate_size"],
        vocab=text["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qkv_bias=bool(text.get("attention_bias", False) or text.get("model_type") == "qwen2"),
        max_context=text.get("max_position_embeddings"),
    )


def gpu_memory(name: str | None, mem: str | None) -> tuple[str, float]:
    """(label, GiB) from a catalog name or a size such as '24GB', '22GiB', '16'."""
    if mem:
        return f"{mem} budget", parse_size_gib(mem)
    if not name:
        raise UnknownNameError("give --gpu (a catalog name such as rtx-4090) or --gpu-mem (such as 24GB)")
    gpus = catalog_gpus()
    if name.lower() not in gpus:
        raise _unknown("GPU", name, gpus)
    return name.lower(), float(gpus[name.lower()]["memory_gib"])


def parse_size_gib(text: str) -> float:
    """GiB in a memory size: '22.5GiB' or '24576MiB' (powers of two), '24GB' or '24000MB'
    (powers of ten, as card makers count: 24GB is 22.35 GiB), or a bare number of GiB."""
    t = text.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", 1.0), ("mib", 1 / 1024), ("gb", 1e9 / GIB), ("mb", 1e6 / GIB), ("g", 1.0)):
        if t.endswith(suffix):
            t, m = t[: -len(suffix)], mult
            break
    else:
        m = 1.0
    try:
        value = float(t) * m
    except ValueError:
        raise ValueError(f"bad memory size {text!r}: use a size such as 22.5GiB, 24GB (10^9 bytes) or a number of GiB") from None
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def kv_bytes(shape: ModelShape, cfg: KVConfig, tokens: int, rows: int = 1, elem_bytes: int = 2, layers: range | None = None) -> int:
    """Bytes a PagedKVCache holds for `rows` rows of `tokens` tokens once full blocks are sealed:
    sink blocks, quantized (or 16-bit) pages with their scales, and the partial tail. The
    same count as `memory_report`'s total_bytes (tests/test_plan.py). layers: those of one
    card of a split model (default all)."""
    cfg = cfg.resolve(shape.layers, shape.head_dim)
    layers = range(shape.layers) if layers is None else layers
    P, H, D, L = cfg.block_size, shape.kv_heads, shape.head_dim, len(layers)
    n = tokens // P
    sinks = min(cfg.sink_blocks, n)
    sizes = _layer_block_bytes(shape, cfg, elem_bytes)
    per_block = sum(sizes[l] for l in layers)
    dense_block = L * 2 * H * P * D * elem_bytes
    tail = (tokens - n * P) * L * 2 * H * D * elem_bytes
    return rows * (sinks * dense_block + (n - sinks) * per_block + tail)


@functools.lru_cache(maxsize=64)
def _layer_block_bytes(shape: ModelShape, cfg: KVConfig, elem_bytes: int) -> tuple[int, ...]:
    """Each layer's bytes of one sealed block (plan's searches ask for them many times)."""
    return tuple(layer_page_bytes(cfg, shape.layers, shape.kv_heads, shape.head_dim, _dtype(elem_bytes)))


def _sealed_block_bytes(shape: ModelShape, cfg: KVConfig, elem_bytes: int) -> int:
    """One sealed block id's bytes over all layers."""
    return sum(_layer_block_bytes(shape, cfg, elem_bytes))


def _dtype(elem_bytes: int):
    import torch

    return {2: torch.bfloat16, 4: torch.float32}[elem_bytes]


def weight_bytes(shape: ModelShape, bits: int) -> int:
    """bf16 weights; or bitsandbytes: int8 (LLM.int8, ~1 byte per weight) or NF4 (half a
    byte plus an fp32 absmax per 64 weights), embeddings and LM head kept 16-bit."""
    layer, embed, head = weight_parts(shape, bits)
    return int(shape.layers * layer + embed + head)


def weight_parts(shape: ModelShape, bits: int) -> tuple[float, int, int]:
    """(one decoder layer's weight bytes, the embeddings', the final norm's and LM head's; a
    tied head is the embeddings, counted there): how a split model's cards share them."""
    if bits not in (16, 8, 4):
        raise ValueError(f"weights bits must be 16, 8 or 4, got {bits}")
    linear = (shape.param_count() - shape.embedding_params() - shape.hidden) // shape.layers - 2 * shape.hidden
    per = {16: 2.0, 8: 1.0, 4: 0.5 + 4 / 64}[bits]
    embed = 2 * shape.vocab * shape.hidden
    return per * linear + 2 * 2 * shape.hidden, embed, 2 * shape.hidden + (0 if shape.tied else embed)


def split_layers(shape: ModelShape, cfg: KVConfig, cards: list[int], *, weights_bits: int = 16, batch: int = 1,
                 chunk: int = 2048, tokens: int | None = None) -> tuple[int, list[int]]:
    """(the longest context a row, the decoder layers each card takes) for a model split over
    `cards` (each a memory budget in bytes) by whole layers in order: embeddings on the first,
    final norm and LM head on the last, each layer's weights and pages on its card. For a
    context, each card in turn takes as many layers as fit beside its fixed share (runtime
    overhead, reserve, one chunk's activations, its end of the weights); the context fits when
    the cards take every layer. With `tokens`, the split at that context (the first cards
    filled first); (0, []) where it does not fit."""
    cfg = cfg.resolve(shape.layers, shape.head_dim)
    layer_w, embed, head = weight_parts(shape, weights_bits)
    last = len(cards) - 1

    def assign(t: int) -> list[int] | None:
        act = activation_bytes(shape, min(chunk, max(t, 1)), t, batch)
        counts, at = [], 0
        for d, total in enumerate(cards):
            room = total - RUNTIME_OVERHEAD - int(FRAGMENTATION * total) - act - (embed if d == 0 else 0) - (head if d == last else 0)
            if room < 0:
                return None
            n = 0
            while at + n < shape.layers:
                cost = layer_w + kv_bytes(shape, cfg, t, batch, layers=range(at + n, at + n + 1))
                if room < cost:
                    break
                room -= cost
                n += 1
            counts.append(n)
            at += n
        return counts if at == shape.layers else None

    if tokens is not None:
        counts = assign(tokens)
        return (tokens, counts) if counts else (0, [])
    best = _largest(lambda t: assign(t) is not None)
    if not best:
        return 0, []
    counts = assign(best)
    return best, counts


def activation_bytes(shape: ModelShape, chunk: int, context: int, batch: int = 1) -> int:
    """Peak transient memory of one prefill chunk of `chunk` tokens at `context` tokens:
    the layer's hidden states, q/k/v, the gated MLP's three intermediate tensors (bf16),
    last-position logits (fp32), and the dense bf16 staging copy of one layer's past that
    staged prefill attention reads (it grows with the context; counted for every chunk, an
    upper bound where the triton backend reads the pages in place instead)."""
    hidden = chunk * shape.hidden * 2 * 4
    qkv = chunk * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * 2
    mlp = chunk * shape.intermediate * 2 * 3
    logits = shape.vocab * 4 * 2
    staging = context * 2 * shape.kv_heads * shape.head_dim * 2
    return batch * (hidden + qkv + mlp + logits + staging)


@dataclass
class Budget:
    gpu: str
    total: int  # bytes of GPU memory planned for
    weights: int
    overhead: int  # RUNTIME_OVERHEAD
    reserve: int  # FRAGMENTATION of the total (activations are per format: PlanRow)

    @property
    def for_kv(self) -> int:
        return self.total - self.weights - self.overhead - self.reserve


@dataclass
class PlanRow:
    format: str
    kv_bytes_per_token: float  # at the planned context (at the model's limit where none fits), sinks and tail included (per row)
    max_tokens: int  # per row, GPU only, the model's limit aside
    max_tokens_offload: int | None  # with a host tier (host_gib > 0): sinks, tails, staging and the newest pages on the GPU
    fits_model_limit: bool  # max_tokens >= the model's max_context
    activations: int
    max_blocks: int = 0  # KVConfig(max_blocks=...) for max_tokens: the pools, allocated once
    unavailable: str = ""  # why this format cannot serve the model (then max_tokens is 0)
    # with a host tier: KVConfig(max_blocks=..., host_blocks=...), the pinned bytes, the GPU's
    # staging bytes, and the decode step predicted at max_tokens_offload from the link
    offload_max_blocks: int = 0
    host_blocks: int = 0
    host_bytes: int = 0
    staging_bytes: int = 0
    offload_step_ms: float = 0.0
    # several GPUs: the decoder layers each card takes, and each card's predicted allocator peak
    # at max_tokens (its weights, its layers' KV and one chunk's activations)
    layers_per_gpu: list[int] = field(default_factory=list)
    gpu_peak_bytes: list[int] = field(default_factory=list)


@dataclass
class Plan:
    model: str
    params: int
    weights_bits: int
    batch: int
    block_size: int
    prefill_chunk: int
    max_context: int | None
    budget: Budget
    rows: list[PlanRow] = field(default_factory=list)
    host_gib: float = 0.0  # the host memory the host tier may pin
    pcie_gbps: float = 0.0  # the link's pinned host-to-device GB/s the offload speed assumes
    gpus: int = 1  # cards of `budget.total` bytes each, the model split over them by layers

    def as_dict(self) -> dict:
        d = asdict(self)
        d["budget"]["for_kv"] = self.budget.for_kv
        return d


def pcie_gbps(gpu: str | None) -> float:
    """The pinned host-to-device GB/s plan assumes for a catalog card (PCIE_GBPS by its
    generation and lanes), or for an unnamed budget (DEFAULT_PCIE, x16)."""
    entry = catalog_gpus().get((gpu or "").lower(), {})
    return PCIE_GBPS[entry.get("pcie", DEFAULT_PCIE)] * entry.get("lanes", 16) / 16


def plan(shape: ModelShape, gpu: str, gpu_gib: float, *, weights_bits: int = 16, kv_bits=(16, 8, 4, 2), batch: int = 1,
         block_size: int = 64, prefill_chunk: int = 2048, host_gib: float = 0.0, pcie: float | None = None, gpus: int = 1) -> Plan:
    """The longest context per row for each KV format (binary search on the exact KV bytes);
    with host_gib, also with a host tier of that much pinned memory, and its decode step over
    a link of `pcie` GB/s (None: the catalog card's, `pcie_gbps`). gpus: that many cards of
    `gpu_gib` each, the model split by layers (`split_layers`), the host tier shared."""
    if batch < 1 or prefill_chunk < 1 or host_gib < 0 or (pcie is not None and pcie <= 0) or gpus < 1:
        raise ValueError(f"batch, prefill_chunk and gpus must be >= 1, host memory >= 0 and the link's GB/s > 0; got {batch}, "
                         f"{prefill_chunk}, {gpus}, {host_gib}, {pcie}")
    if gpus > shape.layers:
        raise ValueError(f"--gpus {gpus}: {shape.name} has {shape.layers} decoder layers, and a card takes whole layers")
    total = int(gpu_gib * GIB)
    budget = Budget(gpu, total, weight_bytes(shape, weights_bits), RUNTIME_OVERHEAD, int(FRAGMENTATION * total))
    out = Plan(shape.name, shape.param_count(), weights_bits, batch, block_size, prefill_chunk, shape.max_context, budget,
               host_gib=host_gib, pcie_gbps=pcie if pcie is not None else pcie_gbps(gpu), gpus=gpus)
    for bits in kv_bits:
        cfg = bits_format(bits, block_size=block_size)
        label = cfg.describe()
        try:
            cfg.resolve(shape.layers, shape.head_dim)
        except ValueError as e:  # e.g. rotation on a head_dim that is not a power of two
            out.rows.append(PlanRow(label, 0.0, 0, None, False, 0, unavailable=str(e)))
            continue

        def need(t: int, cfg=cfg) -> int:
            return kv_bytes(shape, cfg, t, batch) + activation_bytes(shape, min(prefill_chunk, max(t, 1)), t, batch)

        counts: list[int] = []
        if gpus == 1:
            best = _largest(lambda t: need(t) <= budget.for_kv)
        else:
            best, counts = split_layers(shape, cfg, [total] * gpus, weights_bits=weights_bits, batch=batch, chunk=prefill_chunk)
        at = best or shape.max_context or 32768  # where nothing fits, the format's cost at the model's limit
        per_token = kv_bytes(shape, cfg, at, batch) / (at * batch)
        sealed = best // block_size
        row = PlanRow(label, per_token, best, None, shape.max_context is None or best >= shape.max_context,
                      activation_bytes(shape, min(prefill_chunk, max(best, 1)), best, batch),
                      max_blocks=max(0, sealed - min(cfg.sink_blocks, sealed)) * batch, layers_per_gpu=counts)
        if counts:
            row.gpu_peak_bytes = card_peaks(shape, cfg, counts, best, weights_bits, batch, prefill_chunk)
        if host_gib > 0 and (gpus == 1 or counts):  # (several cards that hold not a token: no split to spill from)
            _offload(row, shape, cfg, budget, batch, prefill_chunk, int(host_gib * GIB), out.pcie_gbps, weights_bits)
        out.rows.append(row)
    return out


def card_peaks(shape: ModelShape, cfg: KVConfig, counts: list[int], tokens: int, weights_bits: int = 16, batch: int = 1,
               chunk: int = 2048) -> list[int]:
    """Each card's predicted allocator peak for a model split `counts` layers a card, at `tokens`
    a row: its weights, its layers' KV and one chunk's activations (the CUDA context and the
    reserve are not allocator memory)."""
    layer_w, embed, head = weight_parts(shape, weights_bits)
    act = activation_bytes(shape, min(chunk, max(tokens, 1)), tokens, batch)
    out, at = [], 0
    for d, n in enumerate(counts):
        weights = n * layer_w + (embed if d == 0 else 0) + (head if d == len(counts) - 1 else 0)
        out.append(int(weights + kv_bytes(shape, cfg, tokens, batch, layers=range(at, at + n)) + act))
        at += n
    return out


def _offload(row: PlanRow, shape: ModelShape, cfg: KVConfig, budget: Budget, batch: int, chunk: int, host: int, gbps: float,
             weights_bits: int = 16) -> None:
    """Fill `row`'s host-tier figures. On each GPU: its weights, reserves, one chunk's
    activations (no staging copy of the past: with a host tier attention reads the pages in
    place) and its tokens in its layers' tails, the sinks and a block of tail a row, two
    staging slices, and the device pool (whatever is left, in whole blocks; on several cards,
    the card with the least room per block sets `offload_max_blocks`, since every card holds
    its layers' pages of every block id). In pinned host memory: `host_blocks` blocks. A row
    holds its sinks, then its share of both pools' blocks, then up to a block of tail. The
    decode step reads every host page across the link: host bytes / (gbps * 10^9)."""
    from .offload import RING, stage_blocks_for

    P = cfg.block_size
    cfg = cfg.resolve(shape.layers, shape.head_dim)
    sizes = _layer_block_bytes(shape, cfg, 2)
    per_block = sum(sizes)
    if row.layers_per_gpu:  # the GPU-only split's cards, each with its end of the weights
        layer_w, embed, head = weight_parts(shape, weights_bits)
        last, at, cards = len(row.layers_per_gpu) - 1, 0, []
        for d, n in enumerate(row.layers_per_gpu):
            weights = n * layer_w + (embed if d == 0 else 0) + (head if d == last else 0)
            cards.append((range(at, at + n), budget.total - budget.overhead - budget.reserve - weights))
            at += n
    else:
        cards = [(range(shape.layers), budget.for_kv)]
    device_blocks, staging = None, 0
    for layers, for_kv in cards:
        mine = [sizes[l] for l in layers]
        card_staging = RING * stage_blocks_for(max(sizes), batch) * max(mine, default=0)
        # a chunk's tokens wait in every layer's tail until the next step seals them, and the seal's
        # finiteness check reads them into booleans: 6 bytes a token, layer, KV head and channel
        tails = 6 * chunk * batch * len(layers) * shape.kv_heads * shape.head_dim
        fixed = kv_bytes(shape, cfg, cfg.sink_blocks * P + P - 1, batch, layers=layers) + activation_bytes(shape, chunk, 0, batch) \
            + card_staging + tails
        blocks = max(0, int(for_kv - fixed) // max(1, sum(mine)))
        device_blocks = blocks if device_blocks is None else min(device_blocks, blocks)
        staging += card_staging
    if device_blocks < -(-chunk // P) * batch:  # (a chunk's seal must fit the device pool at once)
        return
    host_blocks = host // per_block
    per_row = (device_blocks + host_blocks) // batch
    row.max_tokens_offload = (cfg.sink_blocks + per_row) * P + P - 1
    row.offload_max_blocks, row.host_blocks = int(device_blocks), int(host_blocks)
    row.host_bytes, row.staging_bytes = int(host_blocks * per_block), int(staging)
    row.offload_step_ms = row.host_bytes / (gbps * 1e9) * 1e3


def offload_step_ms(shape: ModelShape, cfg: KVConfig, context: int, device_blocks: int, gbps: float, batch: int = 1) -> float:
    """The decode step plan predicts for a host tier at `context` tokens a row: the pages past
    the sinks that `device_blocks` GPU pages do not hold, all layers, over `gbps` GB/s."""
    per_block = _sealed_block_bytes(shape, cfg.resolve(shape.layers, shape.head_dim), 2)
    sealed = max(0, context // cfg.block_size - cfg.sink_blocks) * batch
    return max(0, sealed - device_blocks) * per_block / (gbps * 1e9) * 1e3


def _largest(ok) -> int:
    """Largest t >= 0 with ok(t) (ok is monotone); 0 when even one token does not fit."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 34:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo

