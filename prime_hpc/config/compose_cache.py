"""A per-user cache of Hydra compositions. Composing `conf/` onto the typed schema is a pure
function of the config tree, the schema, the overrides and the Hydra/OmegaConf installs,
and costs ~0.15 s (plus ~0.15 s of importing Hydra and converting the schema) each time.
The composed, unresolved config is kept as a pickle in the user's own cache
(`prime_hpc.core.usercache`: `~/.cache/prime-hpc/compose/`), keyed by a hash of those
inputs. Plain `key=value` changes of existing keys are not part of the key: they are
applied to the cached composition as Hydra applies them (`split`, `apply`). So the same
experiment composed again with another learning rate or output_dir (`submit --dry-run`,
then `submit`; each warm-up) skips Hydra entirely.

Only successful compositions are stored (errors always come from Hydra itself), and
interpolations are resolved after loading, so `${oc.env:...}` or relative paths see the
current environment. A file that is not the user's own, or that others can write, or a
symlink, is never unpickled (checked on the descriptor it is read from).
`PRIME_HPC_COMPOSE_CACHE=0` composes with Hydra every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import Container, DictConfig, OmegaConf

from prime_hpc.core import usercache

KEEP = 256  # compositions kept; the oldest go first
# every module of the package a composition loads (what shapes it, besides conf/), from the
# package's root; tests/unit/test_compose_cache.py holds the list to what a composition imports
_CODE = (
    "__init__.py",
    "config/__init__.py",
    "config/schema.py",
    "config/compose.py",
    "config/compose_cache.py",
    "config/walk.py",
    "config/explain.py",
    "config/env_ids.py",
    "core/__init__.py",
    "core/device.py",
    "core/errors.py",
    "core/jobenv.py",
    "core/paths.py",
    "core/usercache.py",
    "sched/__init__.py",
)


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
    h.update(
        json.dumps(
            [sys.version, str(conf), list(overrides), _install_stamp("hydra"), _install_stamp("omegaconf")]
        ).encode()
    )
    package = Path(__file__).resolve().parents[1]
    for name in _CODE:
        h.update(name.encode() + b"\0" + (package / name).read_bytes() + b"\0")
    for path in sorted(p for p in conf.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(conf)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:40]


def load(path: Path) -> Optional[DictConfig]:
    """The composition kept at `path`, unpickled only once the file and its directory are
    known to be the user's alone (`usercache.read`: checked and read on one descriptor)."""
    data = usercache.read(path.parent, path.name)
    if data is None:
        return None
    try:
        cfg = pickle.loads(data)
    except Exception:  # truncated, from another version: compose anew
        return None
    return cfg if isinstance(cfg, DictConfig) else None


def store(path: Path, cfg: DictConfig) -> None:
    """Atomically (readable by the user only), best effort: a cache that cannot be written
    is no error."""
    try:
        usercache.write(path.parent, path.name, pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
        entries = sorted(path.parent.glob("*.pkl"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP]:
            old.unlink(missing_ok=True)
    except (OSError, usercache.Untrusted):
        pass


def cached(conf: Path, overrides: Sequence[str], compose: Callable[[Sequence[str]], DictConfig]) -> DictConfig:
    """`compose(overrides)`'s result: the composition of the overrides that shape it
    (config groups, additions, deletions, anything but a plain value) from the cache, else
    composed and stored, with the plain `key=value` changes applied on top as Hydra
    applies them (after the defaults list, in order, typed by the schema). Should one of
    those not apply cleanly, Hydra composes the whole list (and names the mistake)."""
    if not enabled() or any(o.lstrip("+~").startswith("hydra.") for o in overrides):
        return compose(overrides)  # Hydra's own settings (e.g. a search path) reach beyond conf/
    directory = usercache.directory("compose")
    if directory is None:
        return compose(overrides)
    shaping, changes = split(conf, overrides)
    path = directory / f"{key(conf, shaping)}.pkl"
    cfg = load(path)
    if cfg is None:
        cfg = compose(shaping)
        store(path, cfg)
    try:
        apply(cfg, changes)
    except Exception:
        return compose(overrides)
    return cfg


# A plain value as Hydra's override grammar reads it; anything else (lists, dicts,
# interpolations, escapes, sweeps, inf/nan) stays with Hydra.
_KEY = re.compile(r"[A-Za-z_]\w*(\.(?:[A-Za-z_]\w*|\d+))*")
_INT = re.compile(r"[+-]?(?:0|[1-9]\d*)")
_FLOAT = re.compile(r"[+-]?(?:(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)")
_WORD = re.compile(r"[A-Za-z_/][\w./-]*")
_QUOTED = re.compile(r"'[^'\\$]*'")


def _value(text: str) -> tuple[bool, Any]:
    """(True, value) for a plain value, converted as Hydra converts it; else (False, None)."""
    low = text.lower()
    if low == "null":
        return True, None
    if low in ("true", "false"):
        return True, low == "true"
    if _INT.fullmatch(text):
        return True, int(text)
    if _FLOAT.fullmatch(text):
        return True, float(text)
    if _QUOTED.fullmatch(text):
        return True, text[1:-1]
    if _WORD.fullmatch(text) and low not in ("inf", "nan") and not text.endswith("/"):
        return True, text
    return False, None


def split(conf: Path, overrides: Sequence[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """(overrides Hydra must compose, [(dotted key, value)] changes that can be applied to
    its result). A key that is a config group, or is changed twice, stays with Hydra."""
    shaping: list[str] = []
    changes: list[tuple[str, Any]] = []
    for o in overrides:
        name, eq, text = o.partition("=")
        plain, value = _value(text) if eq else (False, None)
        if plain and _KEY.fullmatch(name) and not (conf / name.replace(".", "/")).is_dir():
            changes.append((name, value))
        else:
            shaping.append(o)
    # Hydra applies value overrides in command-line order: where two touch the same key
    # (or one a section the other is in), the order matters and Hydra keeps it
    names = [k for k, _ in changes]
    values = [o.partition("=")[0].lstrip("+~") for o in shaping]
    values = [v for v in values if not (conf / v.replace(".", "/")).is_dir()]  # group choices come first anyway
    if len(set(names)) < len(names) or any(_related(n, v) for n in names for v in values):
        return list(overrides), []
    return shaping, changes


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def apply(cfg: DictConfig, changes: Sequence[tuple[str, Any]]) -> None:
    """Set each existing leaf as Hydra's `key=value` does (the schema checks the type);
    raises on a key that is not there or is a section."""
    absent = object()
    for name, value in changes:
        node = OmegaConf.select(cfg, name, default=absent)
        if node is absent or isinstance(node, Container):
            raise KeyError(name)
        OmegaConf.update(cfg, name, value, merge=True)
