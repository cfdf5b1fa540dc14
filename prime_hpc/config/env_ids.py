"""Environment ids as users write them, resolved to what to import — one resolver for the
submit-time check (`prime_hpc.config.validate`, which must not import the environment)
and the orchestrator's loader (`prime_hpc.orchestrator.envs`, which does).

An id is either a path or a name. A path starts with `./`, `../`, `/` or `~` (or is `.`
or `..`); submit records it absolute (`absolute`), so a job that starts in another
working directory (SLURM) loads what the submitting shell meant. A path names

1. a module file (`~/envs/math_env.py`);
2. a package directory, with `__init__.py` (`./my_envs/math_env`);
3. an environment project directory, with `pyproject.toml` (the layout verifiers
   environments are published in): its module `<name>.py` or package `<name>/`, where
   `<name>` is the directory's or the project's name with `-` read as `_`.

Anything else is a name, never looked up on disk:

4. an installed module (`reverse_text`, `my_pkg.envs.math`);
5. an installed distribution, by its name (`reverse-text`): its top-level module;
6. `owner/name` (a hub-style environment id): the installed environment named `name`,
   as a module or a distribution (installing it is up to the user).

An id none of these finds fails with one line listing what was tried.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prime_hpc.core.paths import is_local_path


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


def absolute(env_id: str) -> str:
    """A path id made absolute (against the current directory, `~` expanded, `..` and links
    resolved: what it names from here); a name as is."""
    return str(Path(env_id).expanduser().resolve()) if is_local_path(env_id) else env_id


def _project_names(root: Path) -> list[str]:
    """The module names an environment project directory may hold: its own name and its
    `[project] name`, with `-` and `.` read as `_`."""
    import tomllib

    names = [root.name]
    try:
        names.append(str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return list(dict.fromkeys(n.replace("-", "_").replace(".", "_") for n in names))


def resolve_path(env_id: str) -> EnvTarget:
    """A path id (`is_local_path`): a module file, a package directory or a project directory."""
    path = Path(env_id).expanduser().resolve()
    if not path.exists():
        raise UnknownEnv(f"{env_id}: no such file or directory (an id starting with ./, ../, / or ~ is a path)")
    if path.is_file() and path.suffix == ".py":
        return EnvTarget(module=path.stem, path=path)
    if path.is_dir() and (path / "__init__.py").is_file():
        return EnvTarget(module=path.name, path=path)
    if not (path.is_dir() and (path / "pyproject.toml").is_file()):
        raise UnknownEnv(
            f"{env_id}: a path, but neither a .py file, a package directory (with __init__.py) nor an "
            "environment project (a directory with pyproject.toml)"
        )
    tried = []
    for name in _project_names(path):
        if (path / f"{name}.py").is_file():
            return EnvTarget(module=name, path=path / f"{name}.py")
        if (path / name / "__init__.py").is_file():
            return EnvTarget(module=name, path=path / name)
        tried += [f"{name}.py", f"{name}/__init__.py"]
    raise UnknownEnv(
        f"{env_id}: an environment project (pyproject.toml) without its module (tried {', '.join(tried)} in it)"
    )


def resolve(env_id: str) -> EnvTarget:
    if is_local_path(env_id):
        return resolve_path(env_id)
    tried: list[str] = []
    names = [env_id]
    if "/" in env_id:
        owner, _, name = env_id.rpartition("/")
        names = [name]
    for name in names:
        for module in dict.fromkeys([name, name.replace("-", "_")]):
            if _module_exists(module):
                return EnvTarget(module=module)
        tried.append(f"module {name.replace('-', '_')!r}")
        top = _distribution_module(name)
        if top:
            return EnvTarget(module=top)
        tried.append(f"installed distribution {name!r}")
    here = f"; to load the directory {env_id!r} here, give it as ./{env_id}" if Path(env_id).exists() else ""
    raise UnknownEnv(
        f"no environment {env_id!r} (tried {', '.join(tried)} in {Path(sys.executable).parent.parent}); "
        f"install its package (pip install -e <path>) or give a path (./, ../, / or ~){here}"
    )


def import_error(env_id: str) -> Optional[str]:
    """Why `env_id` cannot be loaded (None if it can), without importing it."""
    try:
        resolve(env_id)
    except UnknownEnv as e:
        return str(e)
    return None


def import_env_module(env_id: str):
    """The module an environment id names (`prime_hpc.config.env_ids.resolve`: a local
    package directory or .py file, an installed module, a distribution name such as
    `reverse-text`, or `owner/name`).

    A local package or file is loaded from its path under its own name, and the directory
    that holds it goes to the *end* of `sys.path` (what lies beside it is importable, never
    ahead of the standard library or an installed module: a `json.py` or `httpx.py` in an
    environment's project directory shadows nothing). Its own name may not be one the
    standard library, an installed module or an imported one already has elsewhere: loading
    it would replace that module for the whole process (one line, naming the module)."""
    target = resolve(env_id)
    if target.path is None:
        return importlib.import_module(target.module)
    init = target.path / "__init__.py" if target.path.is_dir() else target.path
    loaded = sys.modules.get(target.module)
    if loaded is not None and _same_file(getattr(loaded, "__file__", None), init):
        return loaded
    _refuse_shadowing(target.module, init)
    parent = str(target.path.parent)
    if parent not in sys.path:
        sys.path.append(parent)
    spec = importlib.util.spec_from_file_location(
        target.module, init, submodule_search_locations=[str(target.path)] if target.path.is_dir() else None
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"{target.path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[target.module] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(target.module, None)
        raise
    return module


def _same_file(a: Optional[str], b: Path) -> bool:
    try:
        return a is not None and Path(a).resolve() == b.resolve()
    except OSError:
        return False


def _refuse_shadowing(name: str, origin: Path) -> None:
    """ImportError when loading `origin` as module `name` would replace another module of
    that name: the standard library's, an imported one's, or an installed one's."""
    other: Optional[str] = None
    if name in sys.stdlib_module_names:
        other = "the standard library's"
    elif name in sys.modules:
        other = f"{getattr(sys.modules[name], '__file__', None) or 'a built-in module'}, imported already"
    else:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is not None and not _same_file(found.origin, origin):
            other = found.origin or "a namespace package"
    if other:
        raise ImportError(
            f"{origin} would be loaded as module {name!r}, which is {other}; rename the environment's module"
        )
