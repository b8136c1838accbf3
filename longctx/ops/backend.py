"""Which backend serves an op: one rule shared by every op that has a Triton kernel."""

from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import BackendUnavailableError

# Compile options every Triton launch passes. Floating-point contraction (FMA) is asked for by
# name: Triton 3.9 warns at a launch that leaves it unset, and says 3.10 turns it off by
# default (ptxas --fmad=false), which would change the kernels' rounding and instruction
# counts from what their tests and benchmarks measured. On 3.6-3.9 it is the default, so the
# compiled code is the same.
TRITON_OPTIONS = dict(enable_fp_fusion=True)


def resolve_backend(backend: str, q: torch.Tensor, head_dim: int | None = None, storage: bool = False) -> str:
    """"auto" -> "triton" for CUDA tensors when triton imports and the kernels serve the
    shape (a power-of-two head_dim of at least 64: their tiles are powers of two, and at 32
    the 4- and 2-bit decode loops' dots and the 2-bit rotated gather do not compile on an H200),
    else "reference".
    storage: the op stores or reads pages for the cache (sealing, gathering) rather than
    attending; "flex" and "flash" are attention backends only, so those ops take "auto"'s
    choice."""
    shape_ok = head_dim is None or (head_dim >= 64 and head_dim & (head_dim - 1) == 0)
    if storage and backend in ("flex", "flash"):
        backend = "auto"
    match backend:
        case "auto":
            return "triton" if q.is_cuda and shape_ok and triton_available() else "reference"
        case "reference":
            return "reference"
        case "triton":
            if not shape_ok:
                raise BackendUnavailableError(f"backend 'triton' needs a power-of-two head_dim >= 64, got {head_dim}; use 'reference' (or 'auto')")
            if not triton_available():
                raise BackendUnavailableError("backend 'triton' needs the triton package: pip install 'longctx[gpu]'")
            if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise BackendUnavailableError("backend 'triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1)")
            return "triton"
        case "flex":
            try:
                from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
            except ImportError:
                raise BackendUnavailableError("backend 'flex' needs FlexAttention (torch >= 2.5)") from None
            return "flex"
        case "flash":
            if not flash_available():
                raise BackendUnavailableError("backend 'flash' needs flash-attn >= 2.6: pip install 'longctx[flash]' (it builds against your CUDA toolkit)")
            if not q.is_cuda:
                raise BackendUnavailableError("backend 'flash' runs on CUDA tensors (flash-attn has no CPU kernels)")
            return "flash"
        case _:
            raise BackendUnavailableError(f"no backend {backend!r}; available: 'auto', 'reference', 'triton', 'flex', 'flash'")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None
