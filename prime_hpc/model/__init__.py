"""Model helpers.

Importing this package does not import torch or transformers: the public functions
are resolved lazily (and the heavy imports happen inside them), which keeps the CLI
and ``python -m prime_hpc.model.tiny`` light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["build_tiny_model", "ensure_tiny_model"]

TINY = "tiny"  # model.name that selects the offline tiny Qwen3 (built on first use)

if TYPE_CHECKING:
    from prime_hpc.model.tiny import build_tiny_model, ensure_tiny_model


def resolve_model(name: str, seed: int = 0) -> str:
    """What to hand to `from_pretrained` / vLLM for the run's `model.name`: the built tiny
    model's directory for "tiny" (and the size ladder's other names, `tiny.SIZES`); for a prime-hpc run directory, its latest complete
    `weights/step_<n>` (e.g. a warm-up's final weights); otherwise the HF id or local path
    unchanged."""
    from prime_hpc.model.tiny import SIZES  # light: no torch

    if name in SIZES:
        from prime_hpc.model.tiny import ensure_tiny_model

        return str(ensure_tiny_model(seed=seed, **SIZES[name]))
    from pathlib import Path

    path = Path(name).expanduser()
    from prime_hpc.core.paths import is_local_path

    if is_local_path(name) and not path.exists():  # a path, not a hub id: never fetched
        from prime_hpc.core.errors import UserError

        raise UserError(f"model.name={name}: no such directory")
    from prime_hpc.rundir import RunDir

    if path.is_dir() and not (path / "config.json").exists() and RunDir(path).weights_dir.is_dir():
        from prime_hpc.core.errors import UserError

        steps = RunDir(path).weight_steps()
        if not steps:
            raise UserError(f"model.name={name}: a run directory without complete weights (weights/step_<n>/STABLE)")
        return str(RunDir(path).weights_step(steps[-1]))
    return name


def __getattr__(name: str) -> Any:
    if name in __all__:
        from prime_hpc.model import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
