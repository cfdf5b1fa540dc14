"""Environment ids as users write them, resolved to what to import — one resolver for the
submit-time check (`prime_hpc.config.validate`, which must not import the environment)
and the orchestrator's loader (`prime_hpc.orchestrator.envs`, which does).

An id is, in this order:

1. a local path to a package directory or a module file (`./my_envs/math_env`,
   `~/envs/math_env.py`);
2. an installed module (`reverse_text`, `my_pkg.envs.math`);
3. an installed distribution, by its name (`reverse-text`): its top-level module;
4. `owner/name` (a hub-style environment id): the installed environment named `name`,
   as a module or a distribution (installing it is up to the user).

An id none of these finds fails with one line listing what was tried.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class EnvTarget:
    module: str  # the module name to import (for a file: its stem)
    path: Optional[Path] = None  # a local package directory or module file


class UnknownEnv(ValueError):
    """No installed module, distribution or local path matches the id; says what was tried."""


def _module_exists(name: str) -> bool:
    if not name or any(not part.isidentifier() for part in name.split(".")):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _distribution_module(name: str) -> Optional[str]:
    """The top-level module of the installed distribution `name` (PEP 503 names compare
    equal with `-`, `_` and `.` mixed), or None."""
    from importlib import metadata

    wanted = name.replace("_", "-").replace(".", "-").lower()
    for module, dists in metadata.packages_distributions().items():
        if any(d.replace("_", "-").replace(".", "-").lower() == wanted for d in dists) and _module_exists(module):
            return module
    return None


def resolve(env_id: str) -> EnvTarget:
    tried: list[str] = []
    path = Path(env_id).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".py":
            return EnvTarget(module=path.stem, path=path.resolve())
        if path.is_dir() and (path / "__init__.py").is_file():
            return EnvTarget(module=path.name, path=path.resolve())
        raise UnknownEnv(f"{env_id}: a path, but neither a package directory (with __init__.py) nor a .py file")
    tried.append("a local path")
    names = [env_id]
    if "/" in env_id and not env_id.startswith((".", "/", "~")):
        owner, _, name = env_id.rpartition("/")
        names = [name]
    for name in names:
        for module in dict.fromkeys([name, name.replace("-", "_")]):
            if _module_exists(module):
                return EnvTarget(module=module)
        tried.append(f"module {name.replace('-', '_')!r}")
        module = _distribution_module(name)
        if module:
            return EnvTarget(module=module)
        tried.append(f"installed distribution {name!r}")
    raise UnknownEnv(f"no environment {env_id!r} (tried {', '.join(tried)} in {Path(sys.executable).parent.parent}); "
                     "install its package (pip install -e <path>) or give a path")


def import_error(env_id: str) -> Optional[str]:
    """Why `env_id` cannot be loaded (None if it can), without importing it."""
    try:
        resolve(env_id)
    except UnknownEnv as e:
        return str(e)
    return None
