"""`bench seal`: what sealing (and appending) add to a decode step over every layer of a real
cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .common import SHAPES, bench_setup, median_of, sealing_share


@dataclass
class SealRow:
    name: str
    context: int
    layers: int  # layers a step appends to and attends in
    block_size: int  # steps between two seals
    attend_ms: float  # attention alone in every layer, median step
    step_ms: float  # append one token + attend in every layer: the median step that seals nothing
    sealing_step_ms: float  # the steps that seal (every layer's full tail), mean

    @property
    def overhead_pct(self) -> float:
        """What sealing adds to the average decode step: the sealing step's excess over the
        median step, spread over the block_size steps between seals (`sealing_share`)."""
        return (self.sealing_step_ms / self.step_ms - 1) * 100 / self.block_size

    @property
    def append_pct(self) -> float:
        """What appending the token adds to attention alone (no sealing)."""
        return (self.step_ms / self.attend_ms - 1) * 100

    def as_dict(self) -> dict:
        return {**asdict(self), "overhead_pct": self.overhead_pct, "append_pct": self.append_pct}


def bench_seal(context: int = 131072, formats=("int4",), shape: str = "llama-3-8b", block_size: int = 64, device: str = "cuda",
               rounds: int = 4, layers: int | None = None) -> list[SealRow]:
    """What sealing adds to decode, through a real PagedKVCache at `context` tokens. A step
    appends one token and attends in each of `layers` layers (default: the shape's), as a
    model's decode step does; its first append seals every layer's full tail, as in a model,
    so a seal's host work (one finiteness check and its sync, the index lists) is paid once a
    step and its quantize launch once a layer. `rounds` x block_size steps run back to back
    (no sync between them, so host and GPU overlap as in decoding), each step timed on the
    GPU timeline; the steps that sealed are compared with the median step that did not, as
    `bench e2e` does for a whole model (`sealing_share`). The model's other work
    (projections, MLP) is left out, so the share is an upper bound of what sealing adds to a
    model's step."""
    from ..cache import PagedKVCache

    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    cfgs, Hq, H, D = bench_setup("seal", formats, block_size, shape)
    L = SHAPES[shape]["layers"] if layers is None else layers
    P = block_size
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, cfg in cfgs.items():
        cache = PagedKVCache(cfg, num_layers=L, num_kv_heads=H, head_dim=D)
        for t0 in range(0, context, 16384):  # every layer gets the same tokens: speed does not depend on them
            n = min(16384, context - t0)
            k = torch.randn(1, H, n, D, device=device, dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, H, n, D, device=device, dtype=torch.bfloat16, generator=g)
            for layer in range(L):
                cache.append(layer, k, v)
            cache.seal()
        del k, v
        q = torch.randn(1, Hq, 1, D, device=device, dtype=torch.bfloat16, generator=g)
        new = torch.randn(P, 2, 1, H, 1, D, device=device, dtype=torch.bfloat16, generator=g)

        def run(steps: int, append: bool = True) -> tuple[list[float], list[bool]]:
            """Each step's GPU time in ms, and whether it sealed."""
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            sealed = []
            torch.cuda.synchronize()
            marks[0].record()
            for i in range(steps):
                before = cache.seals
                for layer in range(L):
                    if append:
                        cache.append(layer, new[i % P, 0], new[i % P, 1])
                    cache.attend(layer, q, return_lse=False)
                marks[i + 1].record()
                sealed.append(cache.seals != before)
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])], sealed

        run(2 * P)  # warm-up: the first seals compile their kernel specialization
        times, sealed = run(rounds * P)  # rounds seals: one every P steps
        extra, _ = sealing_share(times, sealed, P)
        step = median_of([t for t, s in zip(times, sealed) if not s])
        rows.append(SealRow(f"longctx {cfg.describe()}", context, L, P, median_of(run(P, append=False)[0]), step, step + extra))
        cache.reset()
        del cache
        torch.cuda.empty_cache()
    return rows
