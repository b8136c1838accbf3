"""What the ops read: one layer's page pools (`Pages`) and a batch's view of them (`PagedView`).

Notation: B batch rows, H_kv KV heads, P tokens per block (page), D head_dim, N pool slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..quant import BlockFormat


@dataclass
class Pages:
    """One layer's pool of sealed blocks in one format.

    16-bit keys:   k       [N, H_kv, P, D]                    (else None)
    quantized keys: k_codes [N, H_kv, P, D*k_bits/8] uint8, k_scale/k_zero [N, H_kv, P/k_span, D]
    16-bit values: v       [N, H_kv, P, D]                    (else None)
    quantized values: v_codes [N, H_kv, P, D*v_bits/8] uint8, v_scale/v_zero [N, H_kv, P, D/group]
    Quantized parts hold rotated data when fmt.rotate.
    """

    fmt: BlockFormat
    k: torch.Tensor | None = None
    k_codes: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v: torch.Tensor | None = None
    v_codes: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("k", "k_codes", "k_scale", "k_zero", "v", "v_codes", "v_scale", "v_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class PagedView:
    """A batch's keys/values for one layer: sink pages, sealed pages and the unquantized tail.

    block_table: int32 [B, n_blocks] -> physical block id; logical blocks j < n_sink index
                 sink_k/sink_v [N_sink, H_kv, P, D], the others index `pages`.
    tail_k/tail_v: [B, H_kv, T_tail, D], the newest tokens, never quantized yet.
    tail_len:    None (the tail is all of tail_k), or int32 [1] on the device: the tokens of
                 tail_k that count, the rest being room (1 .. T_tail). A decode step replayed
                 from a CUDA graph reads its length there, since a replay cannot change a host
                 int; the triton decode kernel loads it, other paths read it back (one sync).
    n_blocks:    None (every column of block_table counts), or int32 [1] on the device: the
                 columns that count, the rest being room. A CUDA graph's decode step then
                 outlives a seal (a new column, written in place): the triton decode kernel
                 loads the count, other paths read it back (`host_lengths`).
    shared:      the leading logical blocks the rows of each run (shared_run consecutive rows;
                 0: all rows) hold alike, the same ids: a prompt's blocks under its beams, which
                 a kernel may read once for several rows; 0 where none are known. A hint:
                 attention computes the same (up to rounding) either way.
    Row b's token t (0-based over the whole sequence) is logical block t // P, slot t % P,
    or tail slot t - n_blocks * P.
    """

    pages: Pages
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    block_table: torch.Tensor
    n_sink: int
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    tail_len: torch.Tensor | None = None
    n_blocks: torch.Tensor | None = None
    shared: int = 0
    shared_run: int = 0

    @property
    def block_size(self) -> int:
        return self.pages.fmt.block_size

    @property
    def past_len(self) -> int:
        return self.block_table.shape[1] * self.block_size

    @property
    def total_len(self) -> int:
        """Tokens a row holds (with device lengths: at most this many)."""
        return self.past_len + self.tail_k.shape[2]

    def host_lengths(self) -> PagedView:
        """This view with its device lengths (`tail_len`, `n_blocks`) read back (a sync each)
        and the tail and table cut to them: what paths without device lengths take."""
        view = self
        if view.tail_len is not None:
            n = int(view.tail_len.reshape(-1)[0])
            view = dataclasses.replace(view, tail_k=view.tail_k[:, :, :n], tail_v=view.tail_v[:, :, :n], tail_len=None)
        if view.n_blocks is not None:
            nb = int(view.n_blocks.reshape(-1)[0])
            view = dataclasses.replace(view, block_table=view.block_table[:, :nb], n_sink=min(view.n_sink, nb), n_blocks=None,
                                       shared=min(view.shared, nb))
        return view


_PLACEHOLDERS: dict = {}


def placeholders(device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """1-element (uint8, dtype) zeros on `device`, made once: the pointers a kernel takes for
    a layout it does not use (a new pair per call would cost two fill launches)."""
    key = (device, dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = (torch.zeros(1, dtype=torch.uint8, device=device), torch.zeros(1, dtype=dtype, device=device))
    return _PLACEHOLDERS[key]


def kernel_pools(view: PagedView, who: str, code_view=None) -> tuple[torch.Tensor, ...]:
    """The pool tensors a Triton kernel over `view` takes, in its argument order: (k, v,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero). A kernel takes pointers for both
    layouts of each side; the layout a side does not use gets 1-element placeholders.
    Sinks and pools must be contiguous (the kernels derive their strides): else ValueError
    naming `who`. code_view(codes, bits) may re-type the codes (e.g. as int16 words)."""
    pages, fmt = view.pages, view.pages.fmt
    u8, f = placeholders(view.sink_k.device, view.sink_k.dtype)
    k = pages.k if fmt.k_bits == 16 else f
    v = pages.v if fmt.v_bits == 16 else f
    kq = (pages.k_codes, pages.k_scale, pages.k_zero) if fmt.k_bits != 16 else (u8, f, f)
    vq = (pages.v_codes, pages.v_scale, pages.v_zero) if fmt.v_bits != 16 else (u8, f, f)
    named = dict(sink_k=view.sink_k, sink_v=view.sink_v, k=k, v=v, k_codes=kq[0], k_scale=kq[1], k_zero=kq[2],
                 v_codes=vq[0], v_scale=vq[1], v_zero=vq[2])
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{who}: {name} {tuple(t.shape)} must be contiguous (the kernel derives its strides)")
    if code_view is not None:
        kq = (code_view(kq[0], fmt.k_bits), *kq[1:]) if fmt.k_bits != 16 else kq
        vq = (code_view(vq[0], fmt.v_bits), *vq[1:]) if fmt.v_bits != 16 else vq
    return (k, v, *kq, *vq)
