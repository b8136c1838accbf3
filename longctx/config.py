"""Configuration of the KV cache: frozen dataclasses, validated when built.

`KVConfig` says how keys and values are stored (bits, block size, groups, sinks, rotation,
layers kept at 16 bits) and which attention backend reads them. Every invalid value raises
`ValueError` naming the field, the value received and what is allowed. Checks that need the
model's shapes (`group_size` divides `head_dim`, rotation needs a power-of-two `head_dim`,
`layers_16bit` inside the model) run in `KVConfig.resolve`, called when a cache is built.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from importlib import resources

ALLOWED_BITS = (16, 8, 4, 2)
ALLOWED_DTYPES = ("auto", "bfloat16", "float16", "float32")
ALLOWED_BACKENDS = ("auto", "reference", "triton", "flex", "flash")
DEFAULT_GROUP_SIZE = 64
# 8-bit values: whole heads up to 128 channels. At 8 bits a value is off by at most 1/510 of
# its group's range, and the group's width did not register in perplexity (SmolLM2, groups of
# 16, 32 and 64 = its whole head: -0.013, -0.010, -0.004 %); a second scale and zero a token
# only cost bytes and decode time (H200, Llama-3 shape, int8 at 128k: the decode kernel 68.5-68.7
# us with groups of 128 against 72.7-73.0 with 64). At 4 bits and fewer the group
# matters more, and 64 stays.
DEFAULT_GROUP_SIZE_8BIT = 128


def _fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"KVConfig.{name}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class KVConfig:
    """How the KV cache is stored and read.

    bits:        16, 8, 4 or 2 for keys and values (16 keeps them unquantized).
    k_bits:      overrides `bits` for keys (e.g. 8 with v_bits=4: keys carry the error).
    v_bits:      overrides `bits` for values.
    block_size:  tokens per page, a power of two in 16..256.
    k_span:      tokens one K scale and zero-point cover per channel (K's range along
                 tokens): a power of two from 16 that divides block_size; None: the whole
                 page. A page then holds block_size / k_span scale rows per channel: int2
                 keeps its quality with ranges over 16 tokens and its pages at 64.
    group_size:  values are quantized per token in groups of this many channels; must
                 divide head_dim. None: the largest divisor of head_dim up to 64, or up to
                 128 for 8-bit values (one group a head at head_dim 128).
    sink_blocks: leading blocks of each sequence kept unquantized (attention sinks).
    rotate:      multiply K and V by a normalized Hadamard matrix before quantizing
                 (spreads outliers; the lever at 2 bits). Needs a power-of-two head_dim.
    layers_16bit: decoder layers whose pages stay unquantized.
    dtype:       dtype of unquantized data (tails, sinks, 16-bit pages) and of scales;
                 "auto" takes the model's dtype for K/V.
    max_blocks:  cap on quantized pages in device memory (None: grow as needed, by
                 doubling). Set, the pools are allocated at this size when the first block
                 is sealed and never copied later; reaching it spills the oldest pages to
                 the host tier if there is one, else raises `CacheFullError`, which says how
                 many tokens still fit. `longctx plan --json` gives the value per format.
    host_blocks: pages the host tier may hold in pinned host memory (0: no host tier).
                 Needs max_blocks: when the device pools are full, the oldest sealed pages
                 move to host; attention reads them every step through a staging area and
                 merges by LSE (exact). `longctx plan --host-mem` gives the value.
    stage_blocks: pages a staging slice holds on the device (two slices are allocated);
                 None: as many as fit in 128 MiB of one layer's pages.
    backend:     attention backend: "reference" (torch), "triton" (fused kernels; prefill
                 chunks read the pages in place or stage the past, then SDPA), "flex"
                 (FlexAttention over 16-bit pages only, for comparison), "flash" (the past
                 dequantized into bf16 pages in bounded slices, then flash-attn's paged
                 kernel; needs flash-attn), or "auto": triton on CUDA when it imports and
                 the head_dim is a power of two of at least 64, else reference.
    """

    bits: int = 4
    k_bits: int | None = None
    v_bits: int | None = None
    block_size: int = 64
    k_span: int | None = None
    group_size: int | None = None
    sink_blocks: int = 1
    rotate: bool = False
    layers_16bit: tuple[int, ...] = field(default_factory=tuple)
    dtype: str = "auto"
    max_blocks: int | None = None
    host_blocks: int = 0
    stage_blocks: int | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("bits", "k_bits", "v_bits"):
            value = getattr(self, name)
            if value is None and name != "bits":
                continue
            if isinstance(value, bool) or value not in ALLOWED_BITS:
                _fail(name, value, f"choose one of {', '.join(map(str, ALLOWED_BITS))}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs > 256 or bs & (bs - 1):
            _fail("block_size", bs, "a power of two from 16 to 256")
        ks = self.k_span
        if ks is not None and (isinstance(ks, bool) or not isinstance(ks, int) or ks < 16 or ks & (ks - 1) or ks > bs):
            _fail("k_span", ks, f"a power of two from 16 up to block_size={bs}, or None for the whole page")
        gs = self.group_size
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 1):
            _fail("group_size", gs, "a positive integer that divides head_dim, or None")
        sb = self.sink_blocks
        if isinstance(sb, bool) or not isinstance(sb, int) or sb < 0:
            _fail("sink_blocks", sb, "an integer >= 0")
        if not isinstance(self.rotate, bool):
            _fail("rotate", self.rotate, "True or False")
        layers = self.layers_16bit
        if isinstance(layers, (list, set, frozenset)):
            object.__setattr__(self, "layers_16bit", tuple(sorted(layers)))
            layers = self.layers_16bit
        if not isinstance(layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers
        ):
            _fail("layers_16bit", layers, "a sequence of layer indices >= 0")
        if self.dtype not in ALLOWED_DTYPES:
            _fail("dtype", self.dtype, f"one of {', '.join(ALLOWED_DTYPES)}")
        mb = self.max_blocks
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            _fail("max_blocks", mb, "a positive integer, or None for no limit")
        hb = self.host_blocks
        if isinstance(hb, bool) or not isinstance(hb, int) or hb < 0:
            _fail("host_blocks", hb, "an integer >= 0 (0: no host tier)")
        if hb and mb is None:
            _fail("host_blocks", hb, "a host tier needs max_blocks, the device pages that spill to it when full")
        st = self.stage_blocks
        if st is not None and (isinstance(st, bool) or not isinstance(st, int) or st < 1):
            _fail("stage_blocks", st, "a positive integer, or None for the default")
        if self.backend not in ALLOWED_BACKENDS:
            _fail("backend", self.backend, f"one of {', '.join(ALLOWED_BACKENDS)}")

    @property
    def key_bits(self) -> int:
        return self.k_bits if self.k_bits is not None else self.bits

    @property
    def value_bits(self) -> int:
        return self.v_bits if self.v_bits is not None else self.bits

    def layer_bits(self, layer: int) -> tuple[int, int]:
        """(k_bits, v_bits) used by decoder layer `layer`."""
        if layer in self.layers_16bit:
            return 16, 16
        return self.key_bits, self.value_bits

    @property
    def key_span(self) -> int:
        """Tokens a K scale row covers: k_span, or the whole page."""
        return self.k_span if self.k_span is not None else self.block_size

    def resolve(self, num_layers: int, head_dim: int) -> KVConfig:
        """Check the fields that depend on the model and fill `group_size`."""
        gs = self.group_size
        if gs is None:  # the largest divisor of head_dim up to 64 (head_dim 96 -> 48), 128 for 8-bit values
            cap = DEFAULT_GROUP_SIZE_8BIT if self.value_bits == 8 else DEFAULT_GROUP_SIZE
            gs = max(d for d in range(1, min(cap, head_dim) + 1) if head_dim % d == 0)
        if head_dim % gs:
            _fail("group_size", gs, f"must divide the model's head_dim={head_dim}")
        if self.rotate and head_dim & (head_dim - 1):
            _fail("rotate", True, f"rotation needs a power-of-two head_dim, the model has {head_dim}")
        bad = [i for i in self.layers_16bit if i >= num_layers]
        if bad:
            _fail("layers_16bit", self.layers_16bit, f"indices must be < num_layers={num_layers}")
        return dataclasses.replace(self, group_size=gs)

    def describe(self) -> str:
        """Short human-readable name, e.g. 'int4', 'k8v4', 'int2+rot', 'bf16'."""
        kb, vb = self.key_bits, self.value_bits
        name = ("bf16" if kb == 16 else f"int{kb}") if kb == vb else f"k{kb}v{vb}"
        if self.rotate:
            name += "+rot"
        return name

    def block_format(self, layer: int, head_dim: int, kv_heads: int, dtype):
        """The storage format of decoder layer `layer`'s pages (a resolved config: group_size
        filled), K and V of `dtype`."""
        from .quant import BlockFormat

        return BlockFormat(*self.layer_bits(layer), self.block_size, self.group_size, head_dim, kv_heads, dtype, self.rotate,
                           self.key_span)


@functools.cache
def _presets() -> dict[str, dict]:
    import yaml

    return yaml.safe_load(resources.files("longctx").joinpath("configs/kv.yaml").read_text())


# the named format `--kv-bits N` and plan's bits take
BITS_FORMATS = {16: "bf16", 8: "int8", 4: "int4", 2: "int2+rot"}


def bits_format(bits: int, **overrides) -> KVConfig:
    """The named format that `bits` stands for in `chat --kv-bits` and `plan` (BITS_FORMATS:
    2 is int2+rot), with `overrides` on top."""
    if isinstance(bits, bool) or bits not in BITS_FORMATS:
        raise ValueError(f"kv bits must be 16, 8, 4 or 2, got {bits!r}")
    return kv_preset(BITS_FORMATS[bits], **overrides)


def kv_preset_names() -> list[str]:
    """The named KV formats of `longctx/configs/kv.yaml`, in its order."""
    return list(_presets())


def kv_preset(name: str, **overrides) -> KVConfig:
    """The KV format named `name` in `longctx/configs/kv.yaml`, with `overrides` on top
    (e.g. `kv_preset("int4", block_size=128)`)."""
    if name not in _presets():
        raise ValueError(f"unknown format {name!r}; choose from {', '.join(_presets())}")
    return KVConfig(**{**_presets()[name], **overrides})


def plain_config(x):
    """`x` as plain YAML-safe values: a config dataclass as a dict of its fields, paths as strings."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: plain_config(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): plain_config(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_config(v) for v in x]
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def config_yaml(**sections) -> str:
    """Configuration as YAML, a section a keyword (`longctx ... --print-config`): each holds a
    config dataclass, a dict or list of them, or plain values. A dataclass's section holds its
    fields, so `KVConfig(**yaml.safe_load(text)["kv"])` builds the same config again
    (`tests/test_config.py`). The sections stay in block style, one a line or more."""
    import yaml

    def section(key: str, value) -> str:
        if isinstance(value, (dict, list)) and value:
            return yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=None, width=100)
        return f"{key}: {flow_yaml(value)}\n"

    return "".join(section(key, plain_config(value)) for key, value in sections.items())


def flow_yaml(value) -> str:
    """`value` (plain values) as YAML on one line: `{bits: 4, rotate: false}`, `[1, 2]`, `null`."""
    import yaml

    return yaml.safe_dump(value, sort_keys=False, default_flow_style=True, width=10**9).removesuffix("\n").removesuffix("\n...").strip()
