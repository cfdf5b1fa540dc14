"""Per-step metrics of a component: one JSON line per step in `metrics/<component>.jsonl`
(always) and, when `wandb.enabled`, the same numbers in Weights & Biases.

    logger = MetricsLogger(run, "trainer", cfg.wandb, run_name=cfg.name, config=...)
    logger.log(step, {"loss/mean": 0.3, ...})
    logger.close()

W&B layout: ONE W&B run per run, written by ONE process, online or offline. In an RL run
the orchestrator writes it (`wandb_writer=True`) and forwards the trainer's rows from
`metrics/trainer.jsonl` (`follow("trainer")` + `forward()`); the trainer only writes its
JSON lines. In an SFT run the trainer writes it. Each component's metrics are plotted
against its own step key (`<component>/step`); forwarded timing and progress keys that
both components have are prefixed with the component (`trainer/time/step`). The run id is
derived from the output directory (`run_id(run)`), so a resumed or requeued run continues
the same W&B run. With `wandb.log_extras`, every `interval` steps the writer also logs a
table of sampled rollouts (prompt, completion, reward, advantage) and histograms of the
step's rewards and advantages (`log_table`, `log_histograms`); the trainer, every
`wandb.log_extras.trainer.interval` steps, histograms of its trained tokens' entropy and
advantages (`trainer.distributions`), which in an RL run it appends to
`metrics/trainer_distributions.jsonl` for the orchestrator to forward with its rows.

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

from prime_hpc.rundir import RunDir, jsonl_row

HISTOGRAMS = "_distributions"  # metrics/<component>_distributions.jsonl: a forwarded component's histograms


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
        wandb_writer: bool = True,
    ) -> None:
        self.run = run
        self.component = component
        self.path = run.metrics(component)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: `tail -f` works
        self._wandb = None
        self._defined: set[str] = set()
        self._followed: dict[str, int] = {}  # other component -> bytes of its metrics file forwarded
        self._after: dict[str, int] = {}  # other component -> its rows up to this step are already in W&B
        enabled = wandb_cfg is not None and _get(wandb_cfg, "enabled", False)
        if wandb_writer and enabled:
            self._wandb = self._init_wandb(wandb_cfg, run_name, config)
        # W&B on, written by another component: histograms go to a file it forwards
        self._forwarded = enabled and not wandb_writer

    @property
    def wandb(self) -> Any:
        """The W&B run this logger writes (None when it does not)."""
        return self._wandb

    def _init_wandb(self, cfg: Any, run_name: Optional[str], config: Optional[Mapping[str, Any]]) -> Any:
        import wandb

        d = self.run.wandb_dir
        d.mkdir(parents=True, exist_ok=True)
        for var, sub in (("WANDB_CACHE_DIR", ".cache"), ("WANDB_CONFIG_DIR", ".config"), ("WANDB_DATA_DIR", ".data")):
            os.environ.setdefault(var, str(d / sub))
        name = _get(cfg, "name") or run_name or self.run.root.name
        if is_dataclass(config):
            config = asdict(config)
        return wandb.init(
            id=run_id(self.run),
            name=name,
            project=_get(cfg, "project"),
            entity=_get(cfg, "entity"),
            dir=str(d),
            config=dict(config or {}),
            resume="allow",
            mode="offline" if _get(cfg, "offline", False) else "online",
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record `metrics` of `step` (one JSONL line, and a W&B row when enabled)."""
        row = {"step": int(step), "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()
        self._to_wandb(self.component, row)
        return row

    def _to_wandb(self, component: str, row: Mapping[str, Any]) -> None:
        if self._wandb is None:
            return
        step_key = f"{component}/step"
        data = {}
        for k, v in row.items():
            if k in ("step", "time") or v is None:
                continue
            if component != self.component and k.startswith(("time/", "progress/")):
                k = f"{component}/{k}"  # both components have these
            data[k] = v
        for key in [step_key, *(data.keys() - self._defined)]:
            if key not in self._defined:
                self._wandb.define_metric(key, step_metric=None if key == step_key else step_key)
                self._defined.add(key)
        self._wandb.log({**data, step_key: int(row["step"])})

    def follow(self, component: str, after_step: int = 0) -> None:
        """Forward `component`'s metrics file into this logger's W&B run (see `forward`),
        its rows after `after_step` (a resumed run's earlier rows are there already)."""
        for name in (component, component + HISTOGRAMS):
            self._followed.setdefault(name, 0)
            self._after[name] = after_step

    def forward(self) -> int:
        """Log the complete new rows of the followed components to W&B; returns how many."""
        n = 0
        for component, pos in self._followed.items():
            try:
                with open(self.run.metrics(component), "rb") as f:
                    f.seek(pos)
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self._followed[component] = pos + len(complete)
            for row in map(jsonl_row, complete.splitlines()):
                if row is not None and row["step"] > self._after[component]:
                    if component.endswith(HISTOGRAMS):
                        step = row.pop("step")
                        self.log_histograms(step, row, component=component.removesuffix(HISTOGRAMS))
                    else:
                        self._to_wandb(component, row)
                    n += 1
        return n

    def log_table(self, step: int, name: str, columns: list[str | int], rows: list[list[Any]]) -> None:
        if self._wandb is not None and rows:
            import wandb

            self._wandb.log({name: wandb.Table(columns=columns, data=rows), f"{self.component}/step": int(step)})

    def log_histograms(self, step: int, values: Mapping[str, Any], component: Optional[str] = None) -> None:
        """Histograms of `step` in the W&B run: each of `values` a list of numbers, or one
        already binned (`{"counts": [...], "edges": [...]}`, one edge more than counts).
        A component whose W&B run another writes appends them as one JSON line to
        `metrics/<component>_distributions.jsonl`, which the writer forwards (`forward`)."""
        values = {k: v for k, v in values.items() if v}
        if not values:
            return
        if self._wandb is not None:
            import wandb

            data = {
                k: wandb.Histogram(np_histogram=(v["counts"], v["edges"]))
                if isinstance(v, Mapping)
                else wandb.Histogram(v)
                for k, v in values.items()
            }
            self._wandb.log({**data, f"{component or self.component}/step": int(step)})
        elif self._forwarded:
            with open(self.run.metrics(self.component + HISTOGRAMS), "a") as f:
                f.write(json.dumps({"step": int(step), **values}) + "\n")

    def close(self) -> None:
        if self._wandb is not None:
            try:
                self.forward()
                self._wandb.finish()
            finally:
                self._wandb = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
