"""`longctx info`: versions, GPUs and the support matrix of this machine."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def info(file: Path = typer.Argument(None, help="a saved cache (.kvc): what it holds", show_default=False),
         as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables")) -> None:
    """Versions, GPUs, and which attention backends and KV formats work here (and why not);
    or, given a saved cache file, what it holds.

    Examples:
      longctx info --json
      longctx info book.kvc
    """
    from ..info import gpus, support_matrix, versions

    if file is not None:
        return _file_info(file, as_json)

    ver, dev, matrix = versions(), gpus(), support_matrix()
    if as_json:
        typer.echo(json.dumps({"versions": ver, "gpus": dev, "backends": [m.__dict__ for m in matrix]}, indent=1))
        return
    console = Console()
    t = Table(title="Versions")
    t.add_column("component")
    t.add_column("version")
    for k, v in ver.items():
        t.add_row(k, v)
    console.print(t)
    if dev:
        g = Table(title="GPUs")
        for col in ("index", "name", "memory (GiB)", "capability"):
            g.add_column(col)
        for d in dev:
            g.add_row(str(d["index"]), d["name"], str(d["memory_gib"]), d["capability"])
        console.print(g)
    else:
        console.print("GPUs: none visible (CPU only)")
    m = Table(title="Attention backends")
    for col in ("backend", "here", "KV bits", "notes"):
        m.add_column(col)
    for s in matrix:
        m.add_row(s.backend, "[green]yes[/]" if s.available else "[red]no[/]", ",".join(map(str, s.formats)) or "-", escape(s.why))  # (notes quote extras: [flash])
    console.print(m)


def _file_info(path: Path, as_json: bool) -> None:
    from ..persist import read_info

    i = read_info(path)
    turns = [m["role"] for m in i.extra.get("messages", [])]
    fields = {"file": str(i.path), "format version": i.version, "KV format": i.config.describe(), "model": i.model["architecture"],
              "model shape": f"{i.model['layers']} layers, {i.model['kv_heads']} KV heads of {i.model['head_dim']}",
              "model fingerprint": i.model["fingerprint"], "tokens": i.tokens, "rows": i.rows, "pages": i.pages, "dtype": i.dtype,
              "bytes": i.file_bytes, "bytes a token": round(i.file_bytes / max(1, i.tokens * i.rows)),
              "conversation": ", ".join(turns) if turns else "none (a cache only)"}
    if as_json:
        typer.echo(json.dumps({**fields, "config": i.config.__dict__, "model": i.model}, indent=1))
        return
    t = Table(title=f"Saved cache {path.name}", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for k, v in fields.items():
        t.add_row(k, f"{v:,}" if isinstance(v, int) else escape(str(v)))
    Console().print(t)
