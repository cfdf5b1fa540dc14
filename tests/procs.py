"""The processes of this machine as the tests see them, read from /proc (no tools, no
command-line matching: processes are found by their environment and parent chain)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

TICK = os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> Optional[tuple[int, int, float]]:
    """(parent pid, start time, CPU seconds used) of a live process, or None (also for a
    zombie: it has exited, only its parent has not collected its exit status yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICK


def table() -> dict[int, tuple[int, int, float]]:
    """`stat` of every live process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := stat(int(d))):
            out[int(d)] = st
    return out


def descendants(roots: Iterable[int], procs: Optional[dict] = None) -> set[int]:
    """`roots` and every process below them, by parent chain."""
    procs = table() if procs is None else procs
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, st in procs.items():
            if st[0] in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def descends(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is on `pid`'s parent chain."""
    for _ in range(64):
        st = stat(pid)
        if st is None or st[0] <= 1:
            return False
        if st[0] == ancestor:
            return True
        pid = st[0]
    return False


def with_env(entry: str, procs: Optional[dict] = None, prefix: bool = False) -> set[int]:
    """The processes whose environment holds `entry` ("NAME=value"; with `prefix`, an
    entry that starts with it)."""
    needle = entry.encode()
    out = set()
    for pid in table() if procs is None else procs:
        try:
            entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if any(e.startswith(needle) for e in entries) if prefix else needle in entries:
                out.add(pid)
        except OSError:
            continue
    return out


def cmdline(pid: int, limit: int = 120) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:limit].decode(errors="replace")
    except OSError:
        return None
