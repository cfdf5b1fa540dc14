"""What an environment id names, asked of the Python that is to run it.

Run as `<python> -m prime_hpc.envserver.probe <env id>` with only this package on the
path (`config.env_kinds.package_path`: a directory holding nothing but a link to `prime_hpc`), so it
works in any interpreter >= 3.11, whatever verifiers release it has. Imports the module
the id names (`prime_hpc.config.env_ids`: a path, an installed module or distribution,
`owner/name`; else, for a v1 taskset, verifiers' own loader, which also finds the
tasksets verifiers ships) and prints one JSON line:

- `{"kind": "classic", "module"}`: the module has `load_environment(**args)`;
- `{"kind": "v1", "module", "taskset"}`: its `__all__` exports one verifiers v1 `Taskset`
  (verifiers >= 0.4 installed);
- `{"kind": null, "error"}`: neither, or it cannot be imported (the one-line reason).

Always exits 0 once it printed its line; whatever the env's import prints goes to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional


def v1_release() -> Optional[str]:
    """The installed verifiers release when it is one with the v1 taskset API (>= 0.4: its
    root holds nothing but the version), else None."""
    try:
        from importlib import metadata

        version = metadata.version("verifiers")
    except Exception:
        return None
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
    return version if (major, minor) >= (0, 4) else None


def taskset_of(module: Any) -> Optional[str]:
    """The name of the one v1 `Taskset` subclass `module` exports via `__all__`, or None."""
    from verifiers.v1.taskset import Taskset

    found = [
        name
        for name in getattr(module, "__all__", None) or []
        if isinstance(obj := getattr(module, name, None), type) and issubclass(obj, Taskset) and obj is not Taskset
    ]
    return found[0] if len(found) == 1 else None


def import_module(env_id: str) -> Any:
    """The module `env_id` names: prime-hpc's resolver first, then (v1) verifiers' loader."""
    from prime_hpc.config.env_ids import UnknownEnv, import_env_module

    try:
        return import_env_module(env_id)
    except UnknownEnv as e:
        if not v1_release():
            raise
        if not ships(env_id):  # found without importing verifiers (seconds): a typo is answered at once
            raise UnknownEnv(f"{e}; nor is it a taskset verifiers ships") from None
        from verifiers.v1.utils.loaders import import_taskset

        return import_taskset(env_id)


def ships(env_id: str) -> bool:
    """Whether verifiers has a task set of this name in `verifiers.v1.tasksets` (its files
    looked up, nothing imported)."""
    import importlib.util
    from pathlib import Path

    name = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    spec = importlib.util.find_spec("verifiers")
    if not name.isidentifier() or spec is None or not spec.origin:
        return False
    tasksets = Path(spec.origin).parent / "v1" / "tasksets"
    return (tasksets / name / "__init__.py").is_file() or (tasksets / f"{name}.py").is_file()


def probe(env_id: str) -> dict:
    try:
        module = import_module(env_id)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return {"kind": None, "error": f"{type(e).__name__}: {first}"}
    if callable(getattr(module, "load_environment", None)):
        return {"kind": "classic", "module": module.__name__}
    if v1_release():
        try:
            name = taskset_of(module)
        except Exception as e:
            return {"kind": None, "error": f"verifiers v1 cannot be imported: {type(e).__name__}: {e}"}
        if name:
            return {"kind": "v1", "module": module.__name__, "taskset": name}
        return {
            "kind": None,
            "error": f"module {module.__name__} has no load_environment() and exports no one v1 Taskset via __all__",
        }
    return {
        "kind": None,
        "error": f"module {module.__name__} has no load_environment() (and this Python has no verifiers >= 0.4 "
        "for a v1 taskset)",
    }


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # the env's own prints stay off the answer
    answer = probe(sys.argv[1])
    answer["verifiers"] = v1_release()
    out.write(json.dumps(answer) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
