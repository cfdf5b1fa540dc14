"""What a run's `cluster` section comes to, computed once for everyone who needs it (the
placement, the components' configs, validation): trainer ranks and the shared cache."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def trainer_nproc_per_node(cfg: DictConfig) -> int:
    """Trainer ranks per node: `nproc_per_node`, else one per GPU (one on CPU)."""
    c = cfg.cluster
    return int(c.trainer.nproc_per_node or (c.trainer.gpus_per_node if c.device == "cuda" else 1))


def trainer_ranks(cfg: DictConfig) -> int:
    """The trainer's data-parallel world size (one rollout file per rank)."""
    return int(cfg.cluster.trainer.nodes) * trainer_nproc_per_node(cfg)


def cache_root(cfg: DictConfig) -> str:
    """The shared cache of a run (`cluster.cache_dir`, default next to the run)."""
    return str(Path(cfg.cluster.cache_dir or Path(cfg.output_dir).parent / ".prime-hpc-cache").expanduser().absolute())


def own_teacher(cfg: DictConfig) -> bool:
    """The run starts its teacher's servers itself (`orchestrator.teacher.model`): its job
    has a `teacher` group, `cluster.teacher.*` its resources."""
    return bool(cfg.orchestrator.teacher.get("model"))
