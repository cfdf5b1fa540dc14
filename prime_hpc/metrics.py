"""Per-step metrics of a component: one JSON line per step in `metrics/<component>.jsonl`
(always) and, when `wandb.enabled`, the same numbers in Weights & Biases.

    logger = MetricsLogger(run, "trainer", cfg.wandb, run_name=cfg.name, config=...)
    logger.log(step, {"loss/mean": 0.3, ...})
    logger.close()

W&B layout. Every component of a run derives the same W&B run id from the run's output
directory (`run_id(run)`), so the trainer and the orchestrator can log into ONE run:

- online (`wandb.offline=false`): W&B shared mode. Each component attaches to the same run
  id with `x_label=<component>`; the trainer is the primary writer (it exists in both RL
  and SFT runs). Each component's metrics are plotted against its own step key
  (`<component>/step`), so two writers never fight over W&B's global step.
- offline (`wandb.offline=true`, no network): shared mode needs the server, so each
  component writes its own offline run, id `<run id>-<component>`, under
  `<output_dir>/wandb/wandb/`; `wandb sync <output_dir>/wandb/wandb/offline-run-*` uploads
  them later.

W&B's caches and settings are redirected into `<output_dir>/wandb/` too (unless the
environment already says where they go), so nothing lands in the home directory.
Importing this module is cheap; wandb is imported only when enabled.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, is_dataclass
from typing import Any, Mapping, Optional

from prime_hpc.rundir import RunDir


def run_id(run: RunDir) -> str:
    """The W&B run id every component of this run uses (stable across restarts)."""
    return hashlib.sha256(str(run.root).encode()).hexdigest()[:16]


def _clean(value: Any) -> Any:
    """JSON-safe number: tensors and numpy scalars become floats; NaN/inf become None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


class MetricsLogger:
    """Append-only metrics sink of one component (call it on one rank only)."""

    def __init__(
        self,
        run: RunDir,
        component: str,
        wandb_cfg: Any = None,
        run_name: Optional[str] = None,
        config: Optional[Mapping[str, Any]] = None,
        primary: Optional[bool] = None,
    ) -> None:
        self.run = run
        self.component = component
        self.path = run.metrics(component)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: `tail -f` works
        self._wandb = None
        self._defined: set[str] = set()
        if wandb_cfg is not None and _get(wandb_cfg, "enabled", False):
            self._wandb = self._init_wandb(wandb_cfg, run_name, config, primary)

    @property
    def step_key(self) -> str:
        return f"{self.component}/step"

    def _init_wandb(self, cfg: Any, run_name: Optional[str], config: Optional[Mapping[str, Any]],
                    primary: Optional[bool]) -> Any:
        import wandb

        d = self.run.wandb_dir
        d.mkdir(parents=True, exist_ok=True)
        for var, sub in (("WANDB_CACHE_DIR", ".cache"), ("WANDB_CONFIG_DIR", ".config"), ("WANDB_DATA_DIR", ".data")):
            os.environ.setdefault(var, str(d / sub))
        offline = bool(_get(cfg, "offline", False))
        name = _get(cfg, "name") or run_name or self.run.root.name
        if is_dataclass(config):
            config = asdict(config)
        common = dict(project=_get(cfg, "project"), entity=_get(cfg, "entity"), dir=str(d),
                      config=dict(config or {}), resume="allow")
        if offline:
            return wandb.init(id=f"{run_id(self.run)}-{self.component}", name=f"{name}-{self.component}",
                              mode="offline", **common)
        is_primary = self.component == "trainer" if primary is None else primary
        # only the primary may mark the shared run finished
        settings = wandb.Settings(mode="shared", x_primary=is_primary, x_label=self.component,
                                  x_update_finish_state=is_primary)
        return wandb.init(id=run_id(self.run), name=name, settings=settings, **common)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record `metrics` of `step` (one JSONL line, and a W&B row when enabled)."""
        row = {"step": int(step), "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()
        if self._wandb is not None:
            data = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}
            for key in data.keys() - self._defined:
                self._wandb.define_metric(key, step_metric=self.step_key)
                self._defined.add(key)
            if self.step_key not in self._defined:
                self._wandb.define_metric(self.step_key)
                self._defined.add(self.step_key)
            self._wandb.log({**data, self.step_key: int(step)})
        return row

    def close(self) -> None:
        if self._wandb is not None:
            try:
                self._wandb.finish()
            finally:
                self._wandb = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
