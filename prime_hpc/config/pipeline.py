"""Runs that start from another run: a warm-up (SFT) job first, then the run itself from the
warm-up's final weights, submitted together and chained (SLURM `afterok`; locally one
after the other).

`warmup.experiment` names an SFT experiment of `conf/experiment/`. It is composed with
`warmup.overrides`, the run's `cluster` section, `output_dir=<output_dir>/warmup` and
`name=<name>_warmup`; the run itself is composed again with
`model.name=<output_dir>/warmup/weights/step_<warm-up max_steps>`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from prime_hpc.config.compose import compose
from prime_hpc.errors import ConfigError

WARMUP_DIR = "warmup"


def warmup_config(cfg: DictConfig) -> Optional[DictConfig]:
    """The composed warm-up run of `cfg`, or None when it has none."""
    w = cfg.warmup
    if not w.experiment:
        return None
    out = Path(cfg.output_dir) / WARMUP_DIR
    try:
        wcfg = compose([f"+experiment={w.experiment}", *w.overrides, f"output_dir={out}",
                        f"name={cfg.name}_{WARMUP_DIR}", "warmup.experiment=null"])
    except ConfigError as e:
        raise ConfigError(f"warmup ({e.key})", str(e).split(": ", 1)[-1]) from None
    if wcfg.trainer.type != "sft":
        raise ConfigError("warmup.experiment", f"{w.experiment!r} is an {wcfg.trainer.type} run; a warm-up must be an "
                                               "SFT experiment (trainer.type=sft)")
    if wcfg.max_steps is None:
        raise ConfigError("warmup.overrides", f"the warm-up {w.experiment!r} has no max_steps: its final weights "
                                              "must be known when the run is submitted; add max_steps=N")
    wcfg.cluster = OmegaConf.create(OmegaConf.to_container(cfg.cluster))  # the run's cluster, verbatim
    return wcfg


def warmup_weights(wcfg: DictConfig) -> str:
    """Where the warm-up's final weights will be."""
    return str(Path(wcfg.output_dir) / "weights" / f"step_{int(wcfg.max_steps)}")


def compose_stages(overrides: Sequence[str]) -> list[DictConfig]:
    """The runs one submission makes: [run], or [warm-up, run starting from its weights]."""
    cfg = compose(overrides)
    wcfg = warmup_config(cfg)
    if wcfg is None:
        return [cfg]
    return [wcfg, compose([*overrides, f"model.name={warmup_weights(wcfg)}"])]
