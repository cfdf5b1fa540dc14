"""How a trainer process gets its config: `--config <run>/configs/trainer.yaml`, loaded once,
at the edge, into `prime_hpc.config.component.TrainerRunConfig` (the trainer's own sub-tree
plus the run-level values it needs, declared and projected there)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from prime_hpc.config.component import TrainerRunConfig, load


def load_config(path: str | Path) -> TrainerRunConfig:
    """Parse and type-check a trainer YAML; one-line `UserError` on a bad file or key."""
    return load(path, TrainerRunConfig, "trainer")


def parse_args(prog: str, description: str, argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--config", required=True, help="the trainer's YAML (<output_dir>/configs/trainer.yaml, written at submit time)"
    )
    return parser.parse_args(argv)
