"""Which backend serves an op: one rule shared by every op that has a Triton kernel."""

from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import BackendUnavailableError


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """"auto" -> "triton" for CUDA tensors when triton imports, else "reference"."""
    match backend:
        case "auto":
            return "triton" if q.is_cuda and triton_available() else "reference"
        case "reference":
            return "reference"
        case "triton":
            if not triton_available():
                raise BackendUnavailableError("backend 'triton' needs the triton package: pip install 'longctx[gpu]'")
            if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise BackendUnavailableError("backend 'triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1)")
            return "triton"
        case _:
            raise BackendUnavailableError(f"no backend {backend!r}; available: 'auto', 'reference', 'triton'")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
