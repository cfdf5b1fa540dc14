"""`prime-hpc tail`: follow the component logs of the run's latest attempt, each line
prefixed with its component, picking up files that appear later (and a new attempt)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

from prime_hpc.rundir import COMPONENTS, RunDir, tail


def _open_at_end(path: Path, lines: int) -> Optional[tuple]:
    try:
        f = open(path, "rb")
    except OSError:
        return None
    text = tail(path, lines)
    f.seek(0, os.SEEK_END)
    return f, text


def follow(run: RunDir, components: Optional[list[str]] = None, once: bool = False, lines: int = 10,
           poll_s: float = 0.5) -> int:
    comps = components or list(COMPONENTS)
    files: dict[str, tuple] = {}
    attempt = None
    width = max(len(c) for c in comps)
    try:
        while True:
            current = run.latest_logs.resolve() if run.latest_logs.exists() else None
            if current != attempt:
                if attempt is not None:
                    print(f"--- new attempt: {current}", flush=True)
                attempt, files = current, {}
            for c in comps:
                if c in files or attempt is None:
                    continue
                opened = _open_at_end(RunDir.component_log(attempt, c), lines)
                if opened:
                    f, text = opened
                    files[c] = (f, b"")
                    for ln in text.splitlines():
                        print(f"{c:<{width}} | {ln}")
            for c, (f, partial) in list(files.items()):
                chunk = f.read()
                if chunk:
                    data = partial + chunk
                    *complete, rest = data.split(b"\n")
                    for ln in complete:
                        print(f"{c:<{width}} | {ln.decode(errors='replace')}")
                    files[c] = (f, rest)
            sys.stdout.flush()
            if once:
                if attempt is None:
                    print(f"no logs yet in {run.logs_root}", file=sys.stderr)
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0
