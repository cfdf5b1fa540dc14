"""What each component process is started with, typed: `<run>/configs/<component>.yaml`
(written at submit time by `prime_hpc.config.component.component_config`) is loaded once, at
the edge, into the dataclasses below (the trainer's: `prime_hpc.trainer.config`). Every
field has its type and default in one place, the schema: the run-level values here have no
default of their own (`MISSING`: a config file without one is refused), and a component
reads attributes, never a dict with a default restated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Type, TypeVar

from omegaconf import DictConfig, OmegaConf

from prime_hpc.config.cluster import trainer_ranks
from prime_hpc.config.dump import to_yaml
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


def write_component_config(cfg: DictConfig, component: str) -> Path:
    """`<output_dir>/configs/<component>.yaml`, what the component is started with."""
    from prime_hpc.rundir import RunDir, atomic_write_text

    path = RunDir(cfg.output_dir).component_config(component)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, to_yaml(component_config(cfg, component)))
    return path


def bench_section(cfg: DictConfig) -> dict:
    """`bench` as the components get it: its nulls replaced by the run's own values (the
    shape a bench measures is the configured one unless set)."""
    b = OmegaConf.to_container(cfg.bench, resolve=True)
    o = cfg.orchestrator
    b["samples_per_step"] = b["samples_per_step"] or int(o.batch_size)
    b["group_size"] = b["group_size"] or int(o.group_size)
    b["completion_len"] = b["completion_len"] or o.sampling.max_tokens
    return b


def component_config(cfg: DictConfig, component: str) -> dict:
    """What `component` is started with: its own sub-tree plus the run-level values it
    needs, copied in explicitly (a component never reads another component's config)."""
    run_level = {
        "name": cfg.name,
        "output_dir": cfg.output_dir,
        "max_steps": cfg.max_steps,
        "seq_len": cfg.seq_len,
        "async_level": cfg.async_level,
        "seed": cfg.seed,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "device": cfg.cluster.device,
        "ckpt": OmegaConf.to_container(cfg.ckpt, resolve=True),
        "wandb": OmegaConf.to_container(cfg.wandb, resolve=True),
        "bench": bench_section(cfg),
    }
    own = OmegaConf.to_container(cfg[component], resolve=True)
    if component == "inference":
        for k in ("ckpt", "wandb", "max_steps", "async_level", "bench"):
            run_level.pop(k)
        lora = cfg.trainer.model.lora
        run_level["nodes"] = int(cfg.cluster.inference.nodes)  # servers the router waits for
        run_level["address"] = cfg.cluster.address  # bind/publish address (None: the node's own)
        run_level["gpus_per_node"] = int(cfg.cluster.inference.gpus_per_node)
        run_level["lora"] = {"enabled": bool(lora.enabled), "rank": int(lora.rank)}
    if component == "orchestrator":
        run_level["trainer_ranks"] = trainer_ranks(cfg)  # one rollout file per rank
        run_level["micro_batch_size"] = int(cfg.trainer.micro_batch_size)
        run_level["inference_nodes"] = int(cfg.cluster.inference.nodes)
        run_level["lora"] = {"enabled": bool(cfg.trainer.model.lora.enabled), "rank": int(cfg.trainer.model.lora.rank)}
    return {**run_level, component: own}
