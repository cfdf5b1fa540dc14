"""Runs that start from another run: a warm-up (SFT) job first, then the run itself from the
warm-up's final weights, submitted together and chained (SLURM `afterok`; locally one
after the other).

`warmup.experiment` names an SFT experiment of `conf/experiment/`. It is composed with
`warmup.overrides`, then the model the command line chose (`model=`, `model.*=`: the
pipeline's model, which the warm-up trains first), the run's `cluster` section,
`output_dir=<output_dir>/warmup` and `name=<name>_warmup`; the run itself is composed again
with `model.name=<output_dir>/warmup`,
a run directory, which stands for its latest weights (`prime_hpc.model.resolve_model`): the
warm-up's final weights, whenever it stopped (at max_steps, or early at
`trainer.val.stop_below`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from prime_hpc.config.cluster import cache_root
from prime_hpc.config.compose import compose, finish
from prime_hpc.config.overrides import override
from prime_hpc.core.errors import ConfigError

WARMUP_DIR = "warmup"


def warmup_config(cfg: DictConfig, model: Sequence[str] = ()) -> Optional[DictConfig]:
    """The composed warm-up run of `cfg` (of the command line's `model` overrides), or None
    when it has none."""
    w = cfg.warmup
    if not w.experiment:
        return None
    out = Path(cfg.output_dir) / WARMUP_DIR
    try:
        wcfg = compose(
            [
                *warmup_overrides(cfg, model),
                override("output_dir", out),
                override("name", f"{cfg.name}_{WARMUP_DIR}"),
                "warmup.experiment=null",
            ]
        )
    except ConfigError as e:
        raise ConfigError(f"warmup ({e.key})", str(e).split(": ", 1)[-1]) from None
    if wcfg.trainer.type != "sft":
        raise ConfigError(
            "warmup.experiment",
            f"{w.experiment!r} is an {wcfg.trainer.type} run; a warm-up must be an SFT experiment (trainer.type=sft)",
        )
    wcfg.merge_with({"cluster": OmegaConf.to_container(cfg.cluster)})  # the run's cluster, verbatim
    wcfg.cluster.cache_dir = cache_root(cfg)  # and its cache (not one inside the run's directory)
    return wcfg


def warmup_overrides(cfg: DictConfig, model: Sequence[str] = ()) -> list[str]:
    """What the warm-up is composed from (recorded in its job.json): its experiment, its
    overrides, then the pipeline's model (`model_overrides` of the command line)."""
    return [f"+experiment={cfg.warmup.experiment}", *cfg.warmup.overrides, *model]


def model_overrides(overrides: Sequence[str]) -> list[str]:
    """The command line's choice of model (`model=`, `model.name=`, `model.<field>=`): with a
    warm-up, the model the warm-up trains and the run continues from."""
    return [o for o in overrides if o.partition("=")[0].lstrip("+~").split(".")[0] == "model"]


def compose_stages(overrides: Sequence[str]) -> list[DictConfig]:
    """The runs one submission makes: [run], or [warm-up, run starting from its weights]. A
    model given on the command line is the warm-up's, and so, trained, the run's."""
    raw = compose(overrides, resolve=False)
    cfg = finish(copy.deepcopy(raw))
    wcfg = warmup_config(cfg, model_overrides(overrides))
    if wcfg is None:
        return [cfg]
    raw.model.name = str(wcfg.output_dir)  # as `model.name=<warm-up dir>` would, without composing again
    return [wcfg, finish(raw)]
