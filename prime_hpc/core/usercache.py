"""The user's own cache of derived files that are safe to lose (compiled templates, composed
configs): `$XDG_CACHE_HOME/prime-hpc/<name>` (default `~/.cache/...`). Not the run's shared
cache (`PRIME_HPC_CACHE`, which may be a project directory other users write to): what is
kept here is loaded as code or pickles, so a directory or file is used only when it is the
user's own and nobody else can write it."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional


def path(name: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prime-hpc" / name


def trusted(p: Path) -> bool:
    """Owned by this user and writable by nobody else (False if it does not exist)."""
    try:
        st = p.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def directory(name: str) -> Optional[Path]:
    """`path(name)`, created 0700 if missing; None when it cannot be made or is not trusted."""
    p = path(name)
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return p if trusted(p) else None
