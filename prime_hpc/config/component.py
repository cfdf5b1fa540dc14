"""What each component process is started with, typed: `<run>/configs/<component>.yaml`
(written at submit time by `prime_hpc.config.compose.component_config`) is loaded once, at
the edge, into the dataclasses below (the trainer's: `prime_hpc.trainer.config`). Every
field has its type and default in one place, the schema: the run-level values here have no
default of their own (`MISSING`: a config file without one is refused), and a component
reads attributes, never a dict with a default restated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Type, TypeVar

from prime_hpc.config.schema import (
    MISSING,
    BenchConfig,
    CkptConfig,
    InferenceConfig,
    LogConfig,
    ModelConfig,
    OrchestratorConfig,
    WandbConfig,
)
from prime_hpc.core.errors import UserError

T = TypeVar("T")


@dataclass
class ServedLoRA:
    enabled: bool = MISSING  # the trainer trains an adapter (trainer.model.lora.enabled)
    rank: int = MISSING


@dataclass
class OrchestratorRunConfig:
    name: str = MISSING
    output_dir: str = MISSING
    max_steps: Optional[int] = MISSING
    seq_len: int = MISSING
    async_level: int = MISSING
    seed: int = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = MISSING
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    trainer_ranks: int = MISSING  # one rollout file per trainer rank
    micro_batch_size: int = MISSING
    inference_nodes: int = MISSING  # servers to find in endpoints/
    lora: ServedLoRA = field(default_factory=ServedLoRA)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    log: LogConfig = field(default_factory=LogConfig)  # only resolves defaults such as ${log.level}
    bench: BenchConfig = field(default_factory=BenchConfig)  # mode set: a bench run (prime_hpc.orchestrator.bench)


@dataclass
class InferenceRunConfig:
    name: str = MISSING
    output_dir: str = MISSING
    seq_len: int = MISSING
    seed: int = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = MISSING
    nodes: int = MISSING  # servers the router waits for
    address: Optional[str] = MISSING  # bind/publish address; None = the node's own
    gpus_per_node: int = MISSING
    lora: ServedLoRA = field(default_factory=ServedLoRA)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    log: LogConfig = field(default_factory=LogConfig)


def typed(cls: Type[T], raw: Mapping[str, Any], what: str) -> T:
    """`raw` (a component's config as a mapping) as `cls`; one-line `UserError` naming
    `what` on a wrong type or an unknown key."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), dict(raw)))
    except Exception as e:  # omegaconf raises many types, all meaning "bad config"
        raise UserError(f"{what}: {str(e).splitlines()[0]}") from None
    if getattr(cfg, "output_dir", None) == MISSING:
        raise UserError(f"{what}: output_dir is missing")
    return cfg  # type: ignore[return-value]


def load(path: str | Path, cls: Type[T], component: str) -> T:
    """Parse and type-check `<run>/configs/<component>.yaml`."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise UserError(f"cannot read {component} config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{component} config {path} is not valid YAML: {e}") from None
    return typed(cls, raw, f"{component} config {path}")
