"""The log tree of one attempt (`logs/attempt_<k>/`, `RunDir.new_attempt`): where each
component, node, router, env server and worker writes its log. Paths are built from the
attempt's log directory (`logs`); the job scripts build theirs with the same functions
from the shell's `$LOGS` (and a node given as `$n` or SLURM's `%n`), as `layout.<name>`
in `sbatch_templates/`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from prime_hpc.rundir.layout import SERVER_GROUP, SERVER_GROUPS, parse_slot


def sub_run_logs(logs: Path | str, name: str) -> Path:
    """`<attempt>/runs/<name>/`: the logs of run `name` of a job that trains several (its
    orchestrator's `orchestrator.log`, its environments' `envs/`)."""
    return Path(logs) / "runs" / name


def component_log(logs: Path | str, component: str) -> Path:
    """`<attempt>/orchestrator.log`, `trainer.log`, `inference.log` (rank/node 0)."""
    return Path(logs) / f"{component}.log"


def node_log(logs: Path | str, component: str, node: int | str) -> Path:
    return Path(logs) / component / f"node_{node}.log"


def router_log(logs: Path | str, index: int = 0, group: str = SERVER_GROUP) -> Path:
    return Path(logs) / group / f"router_{int(index)}.log"


def log_of(logs: Path | str, component: str, node: Optional[int] = None) -> Path:
    """The log to read first for `component` in the attempt's log tree `logs`: one
    server of the fleet (`inference_<n>`, `inference_<jobid>.<n>`) ->
    `inference/node_<n>.log` (`node_<jobid>.<n>.log`), a teacher's (`teacher_<n>`) ->
    `teacher/node_<n>.log`; the router (`router`, `router_<i>`) ->
    `inference/router_<i>.log`, the teacher's (`teacher_router`) ->
    `teacher/router_0.log`; the trainer, inference or teacher on
    `node` -> `<component>/node_<node>.log`; else (orchestrator, watchdog, a group
    without a node) -> `<component>.log` (`trainer.log`, `inference.log`: node 0's)."""
    group, _, index = component.rpartition("_")
    slot = parse_slot(component)
    if slot is not None:
        return node_log(logs, slot.group, f"{slot.job_id}.{slot.node}" if slot.job_id else slot.node)
    if component == "teacher_router":
        return router_log(logs, 0, "teacher")
    if component == "router" or (group == "router" and index.isdigit()):
        return router_log(logs, int(index) if group else 0)
    if node is not None and component in ("trainer", *SERVER_GROUPS):
        return node_log(logs, component, node)
    return component_log(logs, component)


def srun_log(logs: Path | str, component: str) -> Path:
    """What srun says about a group's tasks (which node's task failed, with what)."""
    return Path(logs) / component / "srun.log"


def torchrun_log_dir(logs: Path | str) -> Path:
    return Path(logs) / "trainer" / "torchrun"


def watchdog_log(logs: Path | str) -> Path:
    return Path(logs) / "watchdog.log"


def group_log_dir(logs: Path | str, component: str) -> Path:
    """Where a group's per-node logs go (`inference/`, `trainer/`)."""
    return Path(logs) / component


def env_logs_root(logs: Path | str) -> Path:
    return Path(logs) / "envs"


def env_log_dir(logs: Path | str, kind: str, env: str) -> Path:
    return env_logs_root(logs) / kind / env


def env_worker_log(logs: Path | str, kind: str, env: str, worker: int = 0) -> Path:
    return env_log_dir(logs, kind, env) / f"env_worker_{int(worker)}.log"


def env_server_log(logs: Path | str, kind: str, env: str) -> Path:
    """An env server's own log (starts and restarts of its workers), beside theirs."""
    return env_log_dir(logs, kind, env) / "env_server.log"
