"""`longctx bench`: decode attention latency of each KV format against peer kernels (GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Measure speed on a GPU (same-process peers, ratios to SDPA dense bf16).", no_args_is_help=True)


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1024 if p.endswith("k") else 1
        try:
            out.append(int(p.rstrip("k")) * mult)
        except ValueError:
            raise ValueError(f"bad size {part!r}: use numbers like 4096 or 32k") from None
    return out


@app.command()
def decode(
    contexts: str = typer.Option("4k,32k,128k,512k", help="context lengths, e.g. 4k,32k,128k"),
    batch: str = typer.Option("1", help="batch sizes, e.g. 1,8"),
    formats: str = typer.Option("int4,int8,bf16", help="longctx formats: bf16,int8,k8v4,int4,int4+rot,int2"),
    shape: str = typer.Option("llama-3-8b", help="model shape: llama-3-8b or smollm2-135m"),
    block_size: int = typer.Option(64, help="tokens per page"),
    no_peers: bool = typer.Option(False, "--no-peers", help="skip SDPA dense and dequantize-all peers"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
) -> None:
    """Per-layer decode attention time, effective bandwidth and ratio to SDPA dense bf16.

    Example: longctx bench decode --contexts 4k,128k --batch 1,8 --formats int4,int8
    """
    from ..bench import SHAPES, bench_decode

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    console = Console()

    def show(case):
        for r in case:
            console.print(f"  {r.name:34s} ctx {r.context:>7d} B{r.batch}: {r.ms:8.4f} ms  {r.tb_per_s:5.2f} TB/s  x{r.ratio_to_sdpa:5.2f}", highlight=False)

    rows = bench_decode(_sizes(contexts), _sizes(batch), [f.strip() for f in formats.split(",")], shape, block_size, not no_peers, progress=show)
    table = Table(title=f"Decode attention per layer ({shape}), median")
    for col in ("kernel", "context", "batch", "ms", "TB/s", "vs SDPA bf16"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in rows:
        table.add_row(r.name, f"{r.context:,}", str(r.batch), f"{r.ms:.4f}", f"{r.tb_per_s:.2f}", f"{r.ratio_to_sdpa:.2f}x")
    console.print(table)
    if as_json:
        as_json.write_text(json.dumps([r.as_dict() for r in rows], indent=1))
