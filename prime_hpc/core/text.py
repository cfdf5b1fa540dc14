"""Plain-text output shared by the commands that print tables (`status`, `list`, `doctor`,
`bench`)."""

from __future__ import annotations

from typing import Sequence


def columns(rows: Sequence[Sequence[str]], indent: str = "", sep: str = "  ") -> list[str]:
    """`rows` (the header first, if any) as aligned lines: every column but the last is
    padded to its widest cell, the last is left as it is (it may be long: a path, a
    detail), cells are joined by `sep` after `indent`, and each line ends without
    trailing blanks. Rows shorter than the longest are padded with empty cells."""
    if not rows:
        return []
    n = max(len(r) for r in rows)
    cells = [[str(c) for c in r] + [""] * (n - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(n - 1)]
    return [(indent + sep.join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]])).rstrip() for r in cells]
