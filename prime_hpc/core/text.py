"""Plain-text output shared by the commands that print tables (`status`, `list`, `doctor`,
`bench`), and the one test of a control character (names and paths that reach a job
script, text written to a terminal)."""

from __future__ import annotations

import re
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


# C0 controls, DEL and C1 controls (U+0080-U+009F: a terminal may read U+009B as CSI), and
# the Unicode line and paragraph separators: what no name or path may hold, and what a
# terminal must not be sent raw
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPED = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")  # all but the tab


def control_char(text: str) -> Optional[str]:
    """The first control character in `text` (C0 including tab and newline, DEL, C1, or
    U+2028/U+2029), as `repr` spells it, or None when it has none."""
    m = _CONTROL.search(text)
    return None if m is None else repr(m.group())[1:-1]


def printable(text: str) -> str:
    """`text` safe to write to a terminal: every control character but the tab (ESC and
    the rest of C0, DEL, C1) written as `\\xNN`, so that text others wrote (a model's
    output, a log, a job.json) cannot move the cursor, retitle the window or recolour
    the screen. Any other character, Unicode included, is kept as it is."""
    return _ESCAPED.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
