"""What a trainer process is started with: `<run>/configs/trainer.yaml`, i.e.
`prime_hpc.config.compose.component_config(cfg, "trainer")` — the trainer's own sub-tree
plus the run-level values it needs. Loaded once, at the edge, into typed dataclasses; the
run-level values have no default here (the schema's is the one default)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from prime_hpc.config.schema import MISSING, BenchConfig, CkptConfig, LogConfig, ModelConfig, TrainerConfig, WandbConfig


@dataclass
class TrainerRunConfig:
    name: str = MISSING
    output_dir: str = MISSING
    max_steps: Optional[int] = MISSING  # absolute target step; None = until the data ends
    seq_len: int = MISSING
    async_level: int = MISSING
    seed: int = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = MISSING  # cpu | cuda
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log: LogConfig = field(default_factory=LogConfig)  # only resolves defaults such as ${log.level}
    bench: BenchConfig = field(default_factory=BenchConfig)  # mode set: a bench run (prime_hpc.trainer.bench)


def load_config(path: str | Path) -> TrainerRunConfig:
    """Parse and type-check a trainer YAML; one-line `UserError` on a bad file or key."""
    from prime_hpc.config.component import load

    return load(path, TrainerRunConfig, "trainer")


def parse_args(prog: str, description: str, argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--config", required=True, help="the trainer's YAML (<output_dir>/configs/trainer.yaml, written at submit time)"
    )
    return parser.parse_args(argv)
