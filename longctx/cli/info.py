"""`longctx info`: versions, GPUs and the support matrix of this machine."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def info(as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables")) -> None:
    """Versions, GPUs, and which attention backends and KV formats work here (and why not).

    Example: longctx info --json
    """
    from ..info import gpus, support_matrix, versions

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
