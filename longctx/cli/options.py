"""Options every command shares: `--print-config`."""

from __future__ import annotations

import typer


def print_config_option():
    return typer.Option(False, "--print-config", help="print the configuration this command would run with, as YAML, and exit")


def print_config(**sections) -> None:
    """Echo `sections` as YAML (`longctx.config.config_yaml`): the command then returns
    before it loads a model or touches a GPU."""
    from ..config import config_yaml

    typer.echo(config_yaml(**sections), nl=False)
