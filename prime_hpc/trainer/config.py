"""What a trainer process is started with: `<run>/configs/trainer.yaml`, i.e.
`prime_hpc.config.compose.component_config(cfg, "trainer")` — the trainer's own sub-tree
plus the run-level values it needs. Loaded once, at the edge, into typed dataclasses."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from prime_hpc.config.schema import MISSING, CkptConfig, LogConfig, ModelConfig, TrainerConfig, WandbConfig
from prime_hpc.errors import UserError


@dataclass
class TrainerRunConfig:
    name: str = "run"
    output_dir: str = MISSING
    max_steps: Optional[int] = None  # absolute target step
    seq_len: int = 2048
    async_level: int = 2
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "cpu"  # cpu | cuda
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log: LogConfig = field(default_factory=LogConfig)  # only resolves defaults such as ${log.level}


def load_config(path: str | Path) -> TrainerRunConfig:
    """Parse and type-check a trainer YAML; one-line `UserError` on a bad file or key."""
    import yaml
    from omegaconf import OmegaConf

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise UserError(f"cannot read trainer config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"trainer config {path} is not valid YAML: {e}") from None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainerRunConfig), raw)
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf raises many types, all meaning "bad config"
        msg = str(e).split("\n")[0]
        raise UserError(f"trainer config {path}: {msg}") from None
    if cfg.output_dir == MISSING:
        raise UserError(f"trainer config {path}: output_dir is missing")
    return cfg  # type: ignore[return-value]


def parse_args(prog: str, description: str, argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True,
                        help="the trainer's YAML (<output_dir>/configs/trainer.yaml, written at submit time)")
    return parser.parse_args(argv)
