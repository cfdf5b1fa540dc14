"""Placement: which het group runs what, on how many nodes, with which resources and
environment. A pure function of the config, so tests can pin it and the templates stay
free of logic.

Het group 0 = orchestrator (head node), 1 = inference servers (+ router on the first),
2 = trainer (torchrun, c10d rendezvous on the first trainer node).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from prime_hpc.rundir import COMPONENTS, RunDir

MODES = ("rl", "doctor")
GROUP_NAMES = COMPONENTS  # het group k runs GROUP_NAMES[k]


@dataclass
class GroupPlan:
    index: int  # het group index (0 head, 1 inference, 2 trainer)
    name: str  # orchestrator | inference | trainer
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: Optional[float]
    argv: list[str]  # what each node runs (trainer: the module argv torchrun starts per rank)
    service: bool = False  # runs until told to stop (inference); the others must finish


@dataclass
class TrainerLaunch:
    nproc_per_node: int
    module: str  # python -m <module> under torchrun
    args: list[str]


@dataclass
class Plan:
    mode: str  # rl | doctor
    name: str  # the run's name (a preflight: "<name>-doctor"); job_name is its SLURM-safe form
    job_name: str
    output_dir: str
    python: str
    backend: str  # slurm | local
    device: str  # cpu | cuda
    groups: list[GroupPlan]
    trainer: TrainerLaunch
    env: dict[str, str] = field(default_factory=dict)  # exported for every component
    env_setup: list[str] = field(default_factory=list)  # user shell lines, verbatim
    time: str = "04:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    sbatch_extra: list[str] = field(default_factory=list)
    signal_delay_s: int = 120
    head_argv: list[str] = field(default_factory=list)  # group 0: submitit's runner (local: replaced)
    router_argv: list[str] = field(default_factory=list)  # on the first inference node, next to its server

    @property
    def run(self) -> RunDir:
        return RunDir(self.output_dir)

    def group(self, name: str) -> GroupPlan:
        return next(g for g in self.groups if g.name == name)


def slurm_job_name(name: str) -> str:
    """SLURM job names are shown everywhere and parsed by tools: keep [A-Za-z0-9._-]."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).strip("_")
    return (cleaned or "run")[:64]


def trainer_nproc_per_node(cfg: DictConfig) -> int:
    c = cfg.cluster
    return int(c.trainer.nproc_per_node or (c.trainer.gpus_per_node if c.device == "cuda" else 1))


def trainer_ranks(cfg: DictConfig) -> int:
    """The trainer's data-parallel world size (one rollout file per rank)."""
    return int(cfg.cluster.trainer.nodes) * trainer_nproc_per_node(cfg)


def _argv(python: str, module: str, *args: str) -> list[str]:
    return [python, "-u", "-m", module, *args]


def make_plan(cfg: DictConfig, mode: str = "rl", python: Optional[str] = None) -> Plan:
    """The placement of one run (`mode=rl`) or of its preflight (`mode=doctor`)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    c = cfg.cluster
    run = RunDir(cfg.output_dir)
    py = python or c.python or sys.executable
    res = {"orchestrator": c.orchestrator, "inference": c.inference, "trainer": c.trainer}
    out = str(run.root)
    if mode == "rl":
        argv = {
            "orchestrator": [],  # the head task: set by the backend (submitit or local)
            "inference": _argv(py, "prime_hpc.inference", "--config", str(run.component_config("inference"))),
            "trainer": [],
        }
        router = _argv(py, "prime_hpc.inference.router", "--config", str(run.component_config("inference")))
        trainer_module = f"prime_hpc.trainer.{cfg.trainer.type}"
        trainer_args = ["--config", str(run.component_config("trainer"))]
    else:
        argv = {
            "orchestrator": [],
            "inference": _argv(py, "prime_hpc.doctor", "node", "--group", "inference", "--output-dir", out),
            "trainer": [],
        }
        router = _argv(py, "prime_hpc.doctor", "node", "--group", "router", "--output-dir", out)
        trainer_module = "prime_hpc.doctor"
        trainer_args = ["node", "--group", "trainer", "--output-dir", out]
    groups = []
    for i, name in enumerate(GROUP_NAMES):
        r = res[name]
        groups.append(
            GroupPlan(
                index=i,
                name=name,
                nodes=int(r.nodes),
                gpus_per_node=int(r.gpus_per_node),
                cpus_per_task=int(r.cpus_per_task),
                mem_gb=r.mem_gb,
                argv=argv[name],
                service=(mode == "rl" and name == "inference"),
            )
        )
    nproc = trainer_nproc_per_node(cfg)
    env = {
        "PRIME_HPC_OUTPUT_DIR": out,
        "PRIME_HPC_DEVICE": c.device,
        "PYTHONUNBUFFERED": "1",
    }
    if c.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if c.backend == "slurm":
        env["SUBMITIT_EXECUTOR"] = "slurm"  # the head task runs under submitit's job environment
    name = cfg.name if mode == "rl" else f"{cfg.name}-doctor"
    return Plan(
        mode=mode,
        name=name,
        job_name=slurm_job_name(name),
        output_dir=out,
        python=py,
        backend=c.backend,
        device=c.device,
        groups=groups,
        trainer=TrainerLaunch(nproc_per_node=int(nproc), module=trainer_module, args=trainer_args),
        env=env,
        env_setup=list(c.env_setup),
        time=c.time,
        partition=c.partition,
        account=c.account,
        qos=c.qos,
        constraint=c.constraint,
        exclude=c.exclude,
        sbatch_extra=list(c.sbatch_extra),
        signal_delay_s=int(c.signal_delay_s),
        router_argv=router,
        # submitit runs the pickled head task from its folder (the SLURM path)
        head_argv=_argv(py, "submitit.core._submit", str(run.submitit_dir)),
    )
