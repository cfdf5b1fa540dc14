"""A per-user cache of Hydra compositions: composing `conf/` onto the typed schema is a pure
function of the config tree, the schema, the overrides and the Hydra/OmegaConf installs,
and costs ~0.15 s (plus ~0.15 s of importing Hydra and converting the schema) each time.
The composed, unresolved config is kept as a pickle in the user's own cache
(`prime_hpc.core.usercache`: `~/.cache/prime-hpc/compose/`), keyed by a hash of all of
those inputs, so composing the same overrides again (`submit --dry-run`, then `submit`;
`doctor`, then `submit`) skips Hydra entirely.

Only successful compositions are stored (errors always come from Hydra itself), and
interpolations are resolved after loading, so `${oc.env:...}` or relative paths see the
current environment. A file that is not the user's own, or that others can write, is
never loaded. `PRIME_HPC_COMPOSE_CACHE=0` composes with Hydra every time.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from prime_hpc.core import usercache

KEEP = 256  # compositions kept; the oldest go first
_CODE = ("schema.py", "compose.py", "compose_cache.py")  # what shapes a composition, besides conf/


def enabled() -> bool:
    return os.environ.get("PRIME_HPC_COMPOSE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _install_stamp(module: str) -> str:
    """Where a package is installed and when it was last written (a reinstall changes it),
    without importing it."""
    from importlib.util import find_spec

    spec = find_spec(module)
    origin = getattr(spec, "origin", None) if spec else None
    if not origin:
        return f"{module}:?"
    return f"{module}:{origin}:{os.stat(origin).st_mtime_ns}"


def key(conf: Path, overrides: Sequence[str]) -> str:
    """Hash of everything a composition depends on."""
    h = hashlib.sha256()
    h.update(json.dumps([sys.version, str(conf), list(overrides),
                         _install_stamp("hydra"), _install_stamp("omegaconf")]).encode())
    here = Path(__file__).resolve().parent
    for name in _CODE:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    for path in sorted(p for p in conf.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(conf)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:40]


def load(path: Path) -> Optional[DictConfig]:
    try:
        if not usercache.trusted(path) or not usercache.trusted(path.parent):
            return None
        cfg = pickle.loads(path.read_bytes())
    except Exception:  # absent, unreadable, truncated, from another version: compose anew
        return None
    return cfg if isinstance(cfg, DictConfig) else None


def store(path: Path, cfg: DictConfig) -> None:
    """Atomically, best effort: a cache that cannot be written is no error."""
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
        entries = sorted(path.parent.glob("*.pkl"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def cached(conf: Path, overrides: Sequence[str], compose: Callable[[], DictConfig]) -> DictConfig:
    """`compose()`'s result for these inputs: from the cache, else composed and stored."""
    if not enabled() or any(o.lstrip("+~").startswith("hydra.") for o in overrides):
        return compose()  # Hydra's own settings (e.g. a search path) reach beyond conf/
    directory = usercache.directory("compose")
    if directory is None:
        return compose()
    path = directory / f"{key(conf, overrides)}.pkl"
    cfg = load(path)
    if cfg is None:
        cfg = compose()
        store(path, cfg)
    return cfg
