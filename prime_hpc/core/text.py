"""Plain-text output shared by the commands that print tables (`status`, `list`, `doctor`,
`bench`)."""

from __future__ import annotations

import time
from typing import Optional, Sequence


def ago(t: Optional[float], now: Optional[float] = None) -> str:
    """How long ago the unix time `t` was: `12s ago`, `5m ago`, `3.1h ago` ('-' for none)."""
    if not t:
        return "-"
    d = max(0.0, (time.time() if now is None else now) - float(t))
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.1f}h ago"


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
