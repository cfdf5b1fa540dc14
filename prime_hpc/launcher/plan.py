"""Placement: which het group runs what, on how many nodes, with which resources and
environment. A pure function of the config, so tests can pin it and the templates stay
free of logic.

Het group 0 = orchestrator (head node, + the router), 1 = inference servers (one per
node, each restartable in its slot), 2 = trainer (torchrun, meeting in file stores of the run's private `rendezvous/`),
3 = the teacher's servers when the run starts its own (`orchestrator.teacher.model`; their
router on the head node too).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from omegaconf import DictConfig

from prime_hpc.config.cluster import cache_root, own_teacher, trainer_nproc_per_node
from prime_hpc.core import jobenv
from prime_hpc.core.device import CPUS_VAR, core_count, visible_devices_env
from prime_hpc.core.net import address_env
from prime_hpc.rundir import COMPONENTS, GROUPS, RunDir
from prime_hpc.rundir.layout import SERVER_GROUPS
from prime_hpc.sched.registry import choose

MODES = ("run", "doctor")
GROUP_NAMES = GROUPS  # het group k runs GROUP_NAMES[k] (of those the job has)


@dataclass
class GroupPlan:
    index: int  # het group index (0 head, 1 inference, 2 trainer, 3 teacher)
    name: str  # orchestrator | inference | trainer | teacher
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: Optional[float]
    argv: list[str]  # what each node runs (trainer: the module argv torchrun starts per rank)
    service: bool = False  # runs until told to stop (inference); the others must finish
    cpu_ids: Optional[str] = None  # cores its tasks are pinned to (taskset); None = the allocation's
    env: dict[str, str] = field(default_factory=dict)  # this group's own environment (threads, cores)

    @property
    def prefix(self) -> list[str]:
        """What goes before the group's command: its environment and core pinning."""
        out = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        return out + (["taskset", "-c", self.cpu_ids] if self.cpu_ids else [])


@dataclass
class TrainerLaunch:
    nproc_per_node: int
    module: str  # python -m <module> under torchrun
    args: list[str]


@dataclass
class After:
    """A job this one starts after: only if it completed (`ok`, SLURM afterok: a pipeline's
    warm-up), or whatever its end (SLURM afterany: a sweep's --max-parallel chain)."""

    job_id: str
    output_dir: str
    ok: bool = True

    @property
    def spec(self) -> str:
        return f"{'afterok' if self.ok else 'afterany'}:{self.job_id}"


@dataclass
class Plan:
    mode: str  # run | doctor
    kind: str  # rl | sft (trainer.type): what the job trains
    name: str  # the run's name (a preflight: "<name>-doctor"); job_name is its SLURM-safe form
    job_name: str
    output_dir: str
    python: str
    backend: str  # slurm | local
    device: str  # cpu | cuda
    groups: list[GroupPlan]
    trainer: TrainerLaunch
    time: str  # cluster.time
    signal_delay_s: int  # cluster.signal_delay_s
    umask: str  # cluster.umask: of every process of the job
    env: dict[str, str] = field(default_factory=dict)  # exported for every component
    env_setup: list[str] = field(default_factory=list)  # user shell lines, verbatim
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    sbatch_extra: list[str] = field(default_factory=list)
    after: list[After] = field(default_factory=list)  # jobs this one starts after
    address: Optional[str] = None  # cluster.address: every node's bind/publish address (None: its own)
    head_argv: list[str] = field(default_factory=list)  # group 0: submitit's runner (local: replaced)
    router_argv: list[str] = field(default_factory=list)  # on the head node, next to the orchestrator
    teacher_router_argv: list[str] = field(default_factory=list)  # the teacher's router, on the head node too
    watchdog_argv: list[str] = field(default_factory=list)  # next to the job script; empty: no watchdog
    fleet_group: Optional[GroupPlan] = None  # cluster.inference_job=own: the group its servers' own jobs run

    @property
    def run(self) -> RunDir:
        return RunDir(self.output_dir)

    def group(self, name: str) -> Optional[GroupPlan]:
        """The plan of group `name`, None when the job does not run it (SFT: no inference)."""
        return next((g for g in self.groups if g.name == name), None)

    @property
    def fleet_nodes(self) -> int:
        """Servers in jobs of their own (`cluster.inference_job=own`); 0: in this job, or none."""
        return self.fleet_group.nodes if self.fleet_group else 0

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    @property
    def het(self) -> bool:
        """A heterogeneous job (several groups); one group is a plain job."""
        return len(self.groups) > 1


def slurm_job_name(name: str) -> str:
    """SLURM job names are shown everywhere and parsed by tools: keep [A-Za-z0-9._-]."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).strip("_")
    return (cleaned or "run")[:64]


def components(cfg: DictConfig, mode: str = "run") -> list[str]:
    """The components a run has, in het-group order: an RL run all three; an SFT run only
    the trainer; a preflight the run's groups plus the head that collects the reports; a
    bench (`bench.mode`) the groups it measures. Its job runs them all but the servers of an
    inference fleet in a job of its own (`job_groups`). An eval job (`eval_job.steps`) runs
    the eval runner in the orchestrator's place, beside the servers; a serve job
    (`serve.enabled`) the process that publishes their URL; a synthesize job
    (`synthesize.out`) the runner that writes the dataset. An RL run whose teacher it
    starts itself (`orchestrator.teacher.model`) has the teacher's servers last."""
    if mode == "run" and job_kind(cfg) in ("eval", "serve", "synthesize"):
        return ["orchestrator", "inference"]
    if cfg.trainer.type == "sft":
        return ["orchestrator", "trainer"] if mode == "doctor" else ["trainer"]
    bench = cfg.bench.mode if mode == "run" else None  # a bench runs only what it measures
    if bench == "trainer":
        return ["trainer"]
    if bench == "inference":
        return ["orchestrator", "inference"]
    return [*COMPONENTS, *(["teacher"] if bench is None and own_teacher(cfg) else [])]


def is_eval_job(cfg: DictConfig) -> bool:
    return bool(cfg.get("eval_job") and cfg.eval_job.steps)


def job_kind(cfg: DictConfig) -> str:
    """What the job does: rl | sft (it trains: `trainer.type`) | eval (`prime-hpc eval`) |
    serve (`prime-hpc serve`) | synthesize (`prime-hpc synthesize`)."""
    if is_eval_job(cfg):
        return "eval"
    if cfg.get("serve") and cfg.serve.enabled:
        return "serve"
    if cfg.get("synthesize") and cfg.synthesize.out:
        return "synthesize"
    return str(cfg.trainer.type)


def own_fleet(cfg: DictConfig, mode: str = "run") -> bool:
    """The run's inference servers run in a plain job of their own, submitted with the run's
    (`cluster.inference_job=own`): an RL run (not a bench, not a preflight)."""
    return mode == "run" and str(cfg.cluster.inference_job) == "own" and set(COMPONENTS) <= set(components(cfg, mode))


def job_groups(cfg: DictConfig, mode: str = "run") -> list[str]:
    """The groups the run's own job runs, in het-group order (`components`, without the
    inference servers when they run in a job of their own)."""
    names = components(cfg, mode)
    return [n for n in names if n != "inference"] if own_fleet(cfg, mode) else names


def machine_cores() -> list[int]:
    """The cores this process may run on (what `cpu_ids: auto` splits)."""
    import os

    return sorted(os.sched_getaffinity(0))


def one_host_cores(cores: list[int], groups: list[str], take_turns: bool = False) -> dict[str, list[int]]:
    """Each group's share of one machine's `cores` when every component runs on it.

    When generation and training take turns (`take_turns`: `async_level` <= 1, the
    rollouts of step n+1 need the policy step n produces) each runs alone while the other
    waits, so trainer, inference and orchestrator all get every core (measured on 2 cores:
    0.83 s per step against 1.10 s with a split; docs/benchmarks.md). Otherwise they run at
    the same time and get cores of their own: the trainer the upper half (at least one
    core), inference the rest, and the orchestrator (and the router), which mostly wait on
    I/O, share the inference cores. Without inference (SFT) the trainer gets every core,
    without a trainer (an eval job, an inference bench) inference does; with a single core
    everything shares it. A teacher's servers share the inference cores (they answer the
    orchestrator between generations)."""
    if len(cores) < 2 or "inference" not in groups or "trainer" not in groups or take_turns:
        return {name: list(cores) for name in groups}
    split = len(cores) - len(cores) // 2
    share = {
        "orchestrator": cores[:split],
        "inference": cores[:split],
        "teacher": cores[:split],
        "trainer": cores[split:],
    }
    return {name: share[name] for name in groups}


def _id_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def group_cpus(cfg: DictConfig, groups: list[str], cores: Optional[list[int]] = None) -> dict[str, Optional[str]]:
    """The core list each group is pinned to ("auto" resolved against `cores`, default
    this machine's), or None where the allocation decides."""
    wanted = {name: cfg.cluster[name].cpu_ids for name in groups}
    take_turns = int(cfg.async_level) <= 1
    auto = (
        one_host_cores(cores if cores is not None else machine_cores(), groups, take_turns)
        if "auto" in wanted.values()
        else {}
    )
    return {name: (_id_list(auto[name]) if v == "auto" else v) for name, v in wanted.items()}


def group_gpus(cfg: DictConfig, groups: list[str]) -> dict[str, Optional[str]]:
    """The GPUs of a node each group sees (None: all its allocation gives). On cuda, a
    local run (every group on this machine) without `gpu_ids` splits the machine's GPUs:
    inference the first `gpus_per_node`, the trainer the next."""
    c = cfg.cluster
    out = {name: (c[name].gpu_ids if c.device == "cuda" else None) for name in groups}
    if c.device == "cuda" and choose(c.backend).one_machine and all(out[g] is None for g in groups):
        start = 0
        for name in ("inference", "trainer", "teacher"):
            n = int(c[name].gpus_per_node) if name in groups else 0
            if n:
                out[name] = f"{start}-{start + n - 1}"
                start += n
    return out


def group_env(
    name: str,
    cpu_ids: Optional[str],
    cpus_per_task: int,
    nproc_per_node: int,
    device: str,
    gpu_ids: Optional[str] = None,
) -> dict[str, str]:
    """Threads per process from the cores the group has: its pinned cores, else the CPUs
    SLURM gives each task; the trainer's are divided among its ranks on the node. The
    orchestrator computes little and gets one thread. On cuda, the group's GPUs."""
    cores = core_count(cpu_ids) if cpu_ids else cpus_per_task
    threads = 1 if name == "orchestrator" else max(1, cores // (nproc_per_node if name == "trainer" else 1))
    env = {"OMP_NUM_THREADS": str(threads)}
    if cpu_ids:
        env[CPUS_VAR] = cpu_ids
    env.update(visible_devices_env(device, gpu_ids))
    return env


def _argv(python: str, module: str, *args: str) -> list[str]:
    return [python, "-u", "-m", module, *args]


@dataclass
class Commands:
    """What each group runs: the servers' and trainer's commands, the router's (beside
    the servers), the teacher's router's, and the trainer module torchrun starts per rank."""

    argv: dict[str, list[str]]
    router: list[str]
    teacher_router: list[str]
    trainer_module: str
    trainer_args: list[str]


def commands(cfg: DictConfig, mode: str, py: str, run: RunDir) -> Commands:
    """A run's components (`mode=run`), or the preflight's probe on every node (`doctor`).
    The head task (group 0) is set by the backend (submitit or the local script)."""
    if mode == "run":
        inference = str(run.component_config("inference"))
        teacher = str(run.component_config("teacher"))
        # a bench run's trainer: the real step on synthetic batches (its own entry point)
        module = "prime_hpc.trainer.bench" if cfg.bench.mode else f"prime_hpc.trainer.{cfg.trainer.type}"
        if cfg.trainer.max_concurrent_runs > 1 and not cfg.bench.mode:  # one trainer for the runs of runs/
            module = "prime_hpc.trainer.multirun"
        return Commands(
            argv={
                "orchestrator": [],
                "inference": _argv(py, "prime_hpc.inference", "--config", inference),
                "trainer": [],
                "teacher": _argv(py, "prime_hpc.inference", "--config", teacher),
            },
            router=_argv(py, "prime_hpc.inference.router", "--config", inference),
            teacher_router=_argv(py, "prime_hpc.inference.router", "--config", teacher),
            trainer_module=module,
            trainer_args=["--config", str(run.component_config("trainer"))],
        )
    out = str(run.root)

    def probe(group: str) -> list[str]:
        return ["node", "--group", group, "--output-dir", out]

    return Commands(
        argv={
            "orchestrator": [],
            "inference": _argv(py, "prime_hpc.job.preflight", *probe("inference")),
            "trainer": [],
            "teacher": _argv(py, "prime_hpc.job.preflight", *probe("teacher")),
        },
        router=_argv(py, "prime_hpc.job.preflight", *probe("router")),
        teacher_router=[],
        trainer_module="prime_hpc.job.preflight",
        trainer_args=probe("trainer"),
    )


def group_plans(
    cfg: DictConfig, mode: str, argv: dict[str, list[str]], nproc: int, cores: Optional[list[int]]
) -> list[GroupPlan]:
    """Each group's nodes, resources, pinning and environment, in het-group order: the
    groups of the run's job, then (`cluster.inference_job=own`) the inference group its
    servers' own jobs run, pinned as if beside the others."""
    c = cfg.cluster
    names = components(cfg, mode)
    in_job = job_groups(cfg, mode)
    cpus = group_cpus(cfg, names, cores)
    gpus = group_gpus(cfg, names)
    return [
        GroupPlan(
            index=i,
            name=name,
            nodes=int(c[name].nodes),
            gpus_per_node=int(c[name].gpus_per_node),
            cpus_per_task=int(c[name].cpus_per_task),
            mem_gb=c[name].mem_gb,
            argv=argv[name],
            service=(mode == "run" and name in SERVER_GROUPS),
            cpu_ids=cpus[name],
            env=group_env(name, cpus[name], int(c[name].cpus_per_task), nproc, c.device, gpus[name]),
        )
        for i, name in enumerate([*in_job, *(n for n in names if n not in in_job)])
    ]


def job_env(cfg: DictConfig) -> dict[str, str]:
    """What every component of the job gets: device, addresses, the shared cache and the
    backend's own variables."""
    c = cfg.cluster
    env = {jobenv.DEVICE_VAR: c.device, "PYTHONUNBUFFERED": "1"}
    env.update(address_env(c.address))
    env[jobenv.CACHE_VAR] = cache_root(cfg)
    env.update(choose(c.backend).job_env)
    return env


def watchdog_argv(cfg: DictConfig, mode: str, py: str, out: str, nproc: int) -> list[str]:
    """The stall watchdog beside the job script (a run with a stall timeout only); with
    inference servers, it also finds hung ones (`inference.stall_timeout_s`)."""
    timeout_s = float(cfg.watchdog.stall_timeout_s)
    if mode != "run" or timeout_s <= 0:
        return []
    argv = _argv(
        py, "prime_hpc.job.watchdog", out, "--stall-timeout-s", f"{timeout_s:g}", "--ranks-per-node", str(nproc)
    )
    if "inference" in components(cfg, mode):
        argv += ["--server-stall-timeout-s", f"{float(cfg.inference.stall_timeout_s):g}"]
    return argv


def make_plan(
    cfg: DictConfig, mode: str = "run", python: Optional[str] = None, cores: Optional[list[int]] = None
) -> Plan:
    """The placement of one run (`mode=run`) or of its preflight (`mode=doctor`);
    `cores`: this machine's cores for `cpu_ids: auto` (default: what this process may use)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    c = cfg.cluster
    run = RunDir(cfg.output_dir)
    py = python or c.python or sys.executable
    out = str(run.root)
    cmd = commands(cfg, mode, py, run)
    nproc = trainer_nproc_per_node(cfg)
    name = cfg.name if mode == "run" else f"{cfg.name}-doctor"
    groups = group_plans(cfg, mode, cmd.argv, nproc, cores)
    in_job = len(job_groups(cfg, mode))
    return Plan(
        mode=mode,
        kind=job_kind(cfg) if mode == "run" else str(cfg.trainer.type),
        name=name,
        job_name=slurm_job_name(name),
        output_dir=out,
        python=py,
        backend=c.backend,
        device=c.device,
        groups=groups[:in_job],
        fleet_group=groups[in_job] if len(groups) > in_job else None,
        trainer=TrainerLaunch(nproc_per_node=int(nproc), module=cmd.trainer_module, args=cmd.trainer_args),
        env=job_env(cfg),
        env_setup=list(c.env_setup),
        time=c.time,
        partition=c.partition,
        account=c.account,
        qos=c.qos,
        constraint=c.constraint,
        exclude=c.exclude,
        sbatch_extra=list(c.sbatch_extra),
        signal_delay_s=int(c.signal_delay_s),
        address=c.address,
        router_argv=cmd.router,
        teacher_router_argv=cmd.teacher_router,
        umask=str(c.umask),
        watchdog_argv=watchdog_argv(cfg, mode, py, out, nproc),
        # submitit runs the pickled head task from its folder (the SLURM path)
        head_argv=_argv(py, "submitit.core._submit", str(run.submitit_dir)),
    )


@dataclass
class InferenceJobPlan:
    """An extra inference job of a running run (`prime-hpc scale`): a plain job of `nodes`
    nodes, one server each, with the run's job-level settings (`plan`: time, partition,
    account, environment ..., after the cluster overrides of the scale) and its inference
    group's resources, pinning and command (`group`, on `nodes` nodes)."""

    plan: Plan
    group: GroupPlan
    job_name: str  # SLURM-safe: "<run>-inference"
    run_check_s: int = 10  # how often the job looks whether the run still runs (its servers leave when not)
    leave_timeout_s: int = 40  # a server told to leave that still runs after this is stopped (its drain: 20 s)
    exclusive: bool = False  # whole nodes (the run's own servers: no node shared with the run's job)

    @property
    def nodes(self) -> int:
        return self.group.nodes


def inference_job_plan(
    cfg: DictConfig,
    nodes: int,
    python: Optional[str] = None,
    cores: Optional[list[int]] = None,
    after: Sequence[After] = (),
    fleet: bool = False,
) -> InferenceJobPlan:
    """The placement of an extra inference job of `nodes` nodes for the run `cfg` (its
    recorded config with the scale's cluster overrides): the run's own inference group,
    on `nodes` nodes (its servers use the run's configs/inference.yaml); `fleet`: the run's own
    servers (cluster.inference_job=own), on whole nodes."""
    plan = make_plan(cfg, "run", python, cores)
    inf = plan.group("inference") or plan.fleet_group
    if inf is None:
        raise ValueError("an extra inference job belongs to an RL run (one with an inference group)")
    return InferenceJobPlan(
        plan=dataclasses.replace(plan, after=list(after)),
        group=dataclasses.replace(inf, nodes=int(nodes)),
        job_name=slurm_job_name(f"{plan.name}-inference"),
        exclusive=fleet,
    )
