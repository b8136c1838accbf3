"""Tables the commands print, whole at any width.

Rich fits a table to the console by wrapping its cells and then cutting them ("Dyn…"). A bench
table of eleven columns at 80 columns (a narrow terminal; any pipe or log file, where rich
assumes 80) came out with every name and figure cut. `show_table` prints a table so that no
cell is cut where there is a way to: whole off a terminal (a log's lines may be long), and on a
terminal too narrow for it, on its side (a column a row) when that fits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.console import Console
from rich.table import Table


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[str]) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _on_its_side(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A column a row, headed by the row's first cell; a row a column of the original."""
    table = Table(title=title)
    table.add_column(columns[0], justify="left")
    for row in rows:
        table.add_column(row[0], justify="right")
    for i, col in enumerate(columns[1:], 1):
        table.add_row(col, *(row[i] for row in rows))
    return table


def _measure(console: Console, table: Table):
    """The table's least and natural widths (rich's own measure is clamped to the console's)."""
    return console.measure(table, options=console.options.update_width(1 << 16))


def show_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[str] = (),
               console: Console | None = None) -> None:
    """Print `rows` (strings, one per column; `left` names the left-justified columns) under
    `columns` on `console` (default: stdout).

    - It fits: as is.
    - Not a terminal: as is, at the table's own width.
    - A terminal where rich can fit it by wrapping words: as is, wrapped.
    - Else, on its side if that fits by wrapping words; as is (cells cut) if neither does.
    """
    console = console or Console()
    table = _table(title, columns, rows, left)
    size = _measure(console, table)
    if size.maximum <= console.width:
        console.print(table)
    elif not console.is_terminal:
        Console(file=console.file, width=size.maximum).print(table)
    elif size.minimum <= console.width or not rows:
        console.print(table)
    else:
        side = _on_its_side(title, columns, rows)
        console.print(side if _measure(console, side).minimum <= console.width else table)
