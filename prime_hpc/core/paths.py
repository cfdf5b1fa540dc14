"""Names that are filesystem paths.

A value such as `model.name`, an environment id or a dataset may name either something to
look up (a hub id `org/name`, a module, a distribution) or a local path. One rule tells
them apart everywhere, on the text alone (nothing is looked at on disk): a local path is
`.` or `..`, or starts with `/`, `./`, `../` or `~`. So `Qwen/Qwen3-0.6B` is a hub id even
when a directory of that name happens to exist here, and `./Qwen/Qwen3-0.6B` is a path that
is never fetched.
"""

from __future__ import annotations

LOCAL_PREFIXES = ("./", "../", "/", "~")


def is_local_path(name: str) -> bool:
    """Whether `name` is written as a local path (see the module docstring)."""
    name = str(name)
    return name in (".", "..") or name.startswith(LOCAL_PREFIXES)
