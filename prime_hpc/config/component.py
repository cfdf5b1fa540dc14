"""What each component process is started with: `<run>/configs/<component>.yaml`, written at
submit time and loaded once, at the edge, into the dataclasses below.

Each component's config is declared once, here, as a dataclass whose fields say where
their value comes from in the run config (`src`): a dotted key (`src("cluster.device")`),
or a function of the run config for what is computed (`trainer_ranks`). `component_config`
projects a composed run config onto it by walking those fields, and `load` reads the file
back into it. A field has its type and default in one place, the schema: the values here
have no default of their own (`MISSING`: a file without one is refused), and a component
reads attributes, never a dict with a default restated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Type, TypeVar, Union, cast

from omegaconf import DictConfig, OmegaConf

from prime_hpc.config import walk
from prime_hpc.config.cluster import trainer_ranks
from prime_hpc.config.dump import to_yaml
from prime_hpc.config.schema import (
    MISSING,
    TEACHER_ENGINE,
    BenchConfig,
    CkptConfig,
    EvalJobConfig,
    InferenceConfig,
    LogConfig,
    ModelConfig,
    OrchestratorConfig,
    ServeConfig,
    SynthesizeConfig,
    TrainerConfig,
    WandbConfig,
    WeightsConfig,
)
from prime_hpc.core.errors import UserError

T = TypeVar("T")
Source = Union[str, Callable[[DictConfig], Any], None]


def src(where: Source, section: Optional[type] = None) -> Any:
    """A field of a component's config whose value is the run config's at dotted key `where`,
    what function `where` computes from the run config, or (`where=None`, a `section`
    dataclass) that section's own fields projected. Without `section` the field has no
    default (`MISSING`)."""
    meta = {"src": where}
    if section is not None:
        return field(default_factory=section, metadata=meta)
    return field(default=MISSING, metadata=meta)


def bench_section(cfg: DictConfig) -> dict:
    """`bench` as the components get it: its nulls replaced by the run's own values (the
    shape a bench measures is the configured one unless set)."""
    b = cast(dict, OmegaConf.to_container(cfg.bench, resolve=True))
    o = cfg.orchestrator
    b["samples_per_step"] = b["samples_per_step"] or int(o.batch_size)
    b["group_size"] = b["group_size"] or int(o.group_size)
    b["completion_len"] = b["completion_len"] or o.sampling.max_tokens
    return b


@dataclass
class ServedLoRA:
    """The trainer's adapter, as the servers that load it and the orchestrator that asks for
    it know it."""

    enabled: bool = src("trainer.model.lora.enabled")
    """The trainer trains an adapter."""
    rank: int = src("trainer.model.lora.rank")
    runs: int = field(default=1, metadata={"src": "trainer.max_concurrent_runs"})
    """Adapters served at once: 1, the run's own; K > 1, a job of several runs, each its
    own adapter named after the run, with its own policy step (a config written before it:
    one run)."""


@dataclass
class ComponentRunConfig:
    """The run-level values every component gets."""

    name: str = src("name")
    output_dir: str = src("output_dir")
    seq_len: int = src("seq_len")
    seed: int = src("seed")
    model: ModelConfig = src("model", ModelConfig)
    device: str = src("cluster.device")
    log: LogConfig = field(default_factory=LogConfig)
    """Not projected: it only resolves defaults such as `${log.level}` of a sub-tree."""


@dataclass
class TrainingRunConfig(ComponentRunConfig):
    """What the trainer and the orchestrator, which step together, both get."""

    max_steps: Optional[int] = src("max_steps")
    async_level: int = src("async_level")
    ckpt: CkptConfig = src("ckpt", CkptConfig)
    wandb: WandbConfig = src("wandb", WandbConfig)
    bench: BenchConfig = src(bench_section, BenchConfig)
    """`mode` set: a bench run (`prime_hpc.trainer.bench`, `prime_hpc.orchestrator.bench`)."""
    weights: WeightsConfig = src("weights", WeightsConfig)
    """`transport=broadcast`: the trainer sends each policy to the servers and writes only a
    marker to weights/step_N between checkpoints; the orchestrator waits for the servers."""


@dataclass
class OrchestratorRunConfig(TrainingRunConfig):
    eval_job: EvalJobConfig = src("eval_job", EvalJobConfig)
    """`steps` set: an eval job; the orchestrator's place runs the eval runner instead."""
    serve: ServeConfig = src("serve", ServeConfig)
    """`enabled`: a serve job; the orchestrator's place publishes the servers' URL instead."""
    synthesize: SynthesizeConfig = src("synthesize", SynthesizeConfig)
    """`out` set: a synthesize job; the orchestrator's place writes an SFT dataset instead."""
    trainer_ranks: int = src(trainer_ranks)
    """One rollout file per trainer rank."""
    micro_batch_size: int = src("trainer.micro_batch_size")
    inference_nodes: int = src("cluster.inference.nodes")
    """Servers to find in endpoints/."""
    inference_job: str = src("cluster.inference_job")
    """own: the servers are another job's (any slot in endpoints/), het: this job's."""
    teacher_nodes: int = field(default=1, metadata={"src": "cluster.teacher.nodes"})
    """The run's own teacher's servers to find in endpoints/ (`orchestrator.teacher.model`);
    a default, like `InferenceRunConfig.group`, for a run written before it."""
    lora: ServedLoRA = src(None, ServedLoRA)
    job_dir: Optional[str] = field(default=None, metadata={"src": "job_dir"})
    """One run of several in a job (`runs/<name>/` of `job_dir`): the job's servers, found in
    its `endpoints/`, serve this run's policy as the adapter named after the run."""
    orchestrator: OrchestratorConfig = src("orchestrator", OrchestratorConfig)


def inference_group(cfg: DictConfig) -> str:
    return "inference"


@dataclass
class InferenceRunConfig(ComponentRunConfig):
    group: str = field(default="inference", metadata={"src": inference_group})
    """The servers it is one of: the run's inference fleet, or its own teacher's
    (`configs/teacher.yaml`: slots teacher_<n>, a router and membership of their own). The
    one field with a default: a run written before it (requeued, resumed) has inference
    servers only."""
    nodes: int = src("cluster.inference.nodes")
    """Servers the router waits for."""
    inference_job: str = src("cluster.inference_job")
    """own: the servers are another job's (any slot in endpoints/), het: this job's."""
    address: Optional[str] = src("cluster.address")
    """Bind/publish address; None = the node's own."""
    gpus_per_node: int = src("cluster.inference.gpus_per_node")
    lora: ServedLoRA = src(None, ServedLoRA)
    inference: InferenceConfig = src("inference", InferenceConfig)
    weights: WeightsConfig = src("weights", WeightsConfig)
    """`transport=broadcast`: the server starts vLLM ready to receive weights over a group."""


@dataclass
class TrainerRunConfig(TrainingRunConfig):
    trainer: TrainerConfig = src("trainer", TrainerConfig)


CONFIGS: dict[str, type] = {
    "orchestrator": OrchestratorRunConfig,
    "inference": InferenceRunConfig,
    "trainer": TrainerRunConfig,
    "teacher": InferenceRunConfig,
}


def teacher_view(cfg: DictConfig) -> DictConfig:
    """The run config as the servers of the run's own teacher see it: the model
    `orchestrator.teacher.model`, the nodes `cluster.teacher`, never an adapter or a weight
    update (the teacher is not trained), its own engine settings where given
    (`orchestrator.teacher.tensor_parallel_size` ...: a teacher is often larger than its
    student), and in opd one token more of context than the run's servers: it scores a
    whole sequence (up to their context) as a prompt that asks for one more token."""
    view = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))
    teacher = str(cfg.orchestrator.teacher.model)
    view.model.name = view.inference.model.name = teacher
    view.cluster.inference = view.cluster.teacher
    view.cluster.inference_job = "het"
    view.trainer.model.lora.enabled = False
    view.weights.transport = "filesystem"
    t = cfg.orchestrator.teacher
    for key in TEACHER_ENGINE:
        if t.get(key) is not None:
            view.inference[key] = view.orchestrator.teacher[key]
    if cfg.orchestrator.training_mode == "opd":
        view.inference.max_model_len = int(view.inference.max_model_len or view.seq_len) + 1
    return view


def project(cls: type, cfg: DictConfig) -> dict:
    """`cls`'s fields (those with a `src`) valued from run config `cfg`, as plain data."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "src" not in f.metadata:
            continue
        where = f.metadata["src"]
        if where is None:
            section = walk.section_type(walk.hints(cls)[f.name])
            assert section is not None, f"{cls.__name__}.{f.name}: src(None) needs a section"
            out[f.name] = project(section, cfg)
        elif callable(where):
            out[f.name] = where(cfg)
        else:
            value = OmegaConf.select(cfg, where, throw_on_missing=True)
            out[f.name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def component_config(cfg: DictConfig, component: str) -> dict:
    """What `component` is started with: its config's fields projected from the run config
    (a component never reads another component's config); the teacher's servers, an
    inference config of the teacher's view of it."""
    if component == "teacher":
        return {**project(CONFIGS[component], teacher_view(cfg)), "group": "teacher"}
    return project(CONFIGS[component], cfg)


def write_component_config(cfg: DictConfig, component: str) -> Path:
    """`<output_dir>/configs/<component>.yaml`, what the component is started with."""
    from prime_hpc.rundir import RunDir, atomic_write_text

    path = RunDir(cfg.output_dir).component_config(component)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, to_yaml(component_config(cfg, component)))
    return path


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
