"""Tables the commands print, fitted to the terminal: a table too wide for the console is printed
as several tables, each with the key columns (the optimizer, its mode) and as many of the others
as fit, instead of rich's way of squeezing it (cells cut to ``adamw8…``, labels wrapped over three
lines). Nothing is cut, and a row takes two lines at most: a column is never narrower than its
widest cell, unless it was made with ``overflow="fold"`` (free text, such as a param group's
options), which may wrap at its spaces onto a second line; a header may wrap onto two lines too.

:func:`console` is the console they print to: the terminal's width, or ``$COLUMNS`` where it is
set, or 120 columns for a pipe.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["console", "new_table", "print_table", "table_width"]

PIPE_WIDTH = 120  # a pipe or a file, without $COLUMNS


def console(*, pipe_width: int = PIPE_WIDTH, **kwargs: Any) -> Console:
    """A console as wide as the terminal, or ``$COLUMNS`` when set, else ``pipe_width``."""
    out = Console(**kwargs)
    if "width" in kwargs or out.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        return out  # rich reads $COLUMNS itself
    return Console(width=pipe_width, **kwargs)


def new_table(title: Any = None) -> Table:
    """A table in the commands' style (no outer edge, bold headers), for :func:`print_table`."""
    return Table(title=title, show_edge=False, header_style="bold")


def _cell_widths(cell: Any) -> tuple[int, int]:
    """(longest word, longest line) of a cell, in terminal columns."""
    text = Text.from_markup(cell) if isinstance(cell, str) else Text(str(cell))
    lines = max((line.cell_len for line in text.split()), default=0)
    return max((Text(word).cell_len for word in text.plain.split()), default=0), lines


def two_lines(cell: Any) -> int:
    """The narrowest width at which ``cell``'s words, wrapped at its spaces, take two lines at most."""
    text = Text.from_markup(cell) if isinstance(cell, str) else Text(str(cell))
    words = [Text(w).cell_len for w in text.plain.split()]
    if len(words) <= 1:
        return max(words, default=0)

    def lines_at(width: int) -> int:
        lines, used = 1, -1
        for w in words:
            if used + 1 + w > width:
                lines, used = lines + 1, w
            else:
                used += 1 + w
        return lines

    width = max(words)
    while lines_at(width) > 2:
        width += 1
    return width


def _widths(table: Table) -> tuple[list[int], list[int]]:
    """The narrowest each column can be without cutting a cell or taking a third line, its header
    included (a folding column: two lines of its widest cell; any other, its widest cell on one
    line and its header on two), and its width on one line."""
    narrowest, natural = [], []
    for col in table.columns:
        cells = [_cell_widths(c)[1] for c in col.cells]
        natural.append(max([_cell_widths(col.header)[1], *cells]))
        folded = [two_lines(c) for c in col.cells] if col.overflow == "fold" else cells
        narrowest.append(max([two_lines(col.header), *folded]))
    return narrowest, natural


def table_width(widths: list[int]) -> int:
    """Columns of a :func:`new_table` whose columns are ``widths`` wide: one space of padding each
    side of a cell, one separator between cells, no edge."""
    return sum(w + 2 for w in widths) + max(len(widths) - 1, 0)


def _fit(narrowest: list[int], natural: list[int], width: int) -> list[int]:
    """Each column's width: its natural one, less what the folding columns (those whose narrowest
    is below natural) give up, widest first, for the table to fit ``width``."""
    widths = list(natural)
    while table_width(widths) > width:
        slack = [(w - n, i) for i, (w, n) in enumerate(zip(widths, narrowest)) if w > n]
        if not slack:
            break
        widths[max(slack)[1]] -= 1
    return widths


def _part(table: Table, indices: list[int], title: Any, widths: list[int]) -> Table:
    part = new_table(title)
    part.title_style = table.title_style
    for i, width in zip(indices, widths):
        col = table.columns[i]
        # A fixed width: rich's own sharing of a narrow terminal breaks words ("referenc" / "e"). A
        # column narrower than its header wraps it; its cells (no wider than the column) do not wrap.
        part.add_column(col.header, justify=col.justify, style=col.style, header_style=col.header_style,
                        no_wrap=col.overflow != "fold" and width >= _cell_widths(col.header)[1], overflow=col.overflow,
                        width=width)  # fmt: skip
    cells = [list(table.columns[i].cells) for i in indices]
    for r in range(table.row_count):
        part.add_row(*(c[r] for c in cells))
    return part


def print_table(out: Console, table: Table, *, keys: int = 1) -> None:
    """Print ``table`` whole if it fits ``out.width``, else as a stack of tables that each repeat
    the first ``keys`` columns and take as many of the next columns, in order, as fit. A column
    that does not fit beside the keys gets a table of its own (where it may still be too wide:
    then rich wraps or cuts it, the only case it does)."""
    narrowest, natural = _widths(table)
    keys = min(keys, len(natural))

    def show(indices: list[int], title: Any) -> None:
        out.print(_part(table, indices, title, _fit([narrowest[i] for i in indices], [natural[i] for i in indices], out.width)))

    if table_width(narrowest) <= out.width or len(natural) <= keys:
        show(list(range(len(natural))), table.title)
        return
    base = list(range(keys))
    parts: list[list[int]] = []
    current: list[int] = []
    for i in range(keys, len(natural)):
        if current and table_width([narrowest[j] for j in base + current + [i]]) > out.width:
            parts.append(current)
            current = []
        current.append(i)
    parts.append(current)
    for n, indices in enumerate(parts):
        if n:
            out.print()
        show(base + indices, table.title if n == 0 or not table.title else f"{table.title} (continued)")
