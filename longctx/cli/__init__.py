"""The `longctx` command line: a typer app, one module per command group.

`main()` turns the errors longctx raises on purpose (and bad input) into one readable line
on stderr with exit code 2, instead of a traceback.
"""

from __future__ import annotations

import sys

import typer

from .bench import app as bench_app
from .chat import chat
from .eval import app as eval_app
from .info import info

app = typer.Typer(
    name="longctx",
    help="Paged int8/int4/int2 KV caches for long contexts on one GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")
app.command("info")(info)
app.command("chat")(chat)


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    from ..errors import LongCtxError

    try:
        app(args=argv, standalone_mode=True)
    except (LongCtxError, ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)

