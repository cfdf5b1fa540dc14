"""SLURM backend on top of submitit: submitit pickles the head task, submits, parses the
job id and tracks state through sacct; we render the het script (submitit cannot emit het
jobs itself) and aggregate the per-component states of a het job (sacct lists them as
`<id>+0`, `<id>+1`, ... and never as a bare `<id>`)."""
from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
from typing import Any, Optional

import submitit
from submitit.slurm.slurm import SlurmJob, SlurmInfoWatcher

from prime_hpc.errors import LaunchError
from prime_hpc.launcher.plan import GROUP_NAMES, Plan
from prime_hpc.launcher.render import render_sbatch

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "RESIZING", "SUSPENDED", "REQUEUE_HOLD",
          "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"}
FAILED_FIRST = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "CANCELLED")


def minutes(slurm_time: str) -> Optional[int]:
    """A SLURM time limit in minutes (None = unlimited). Formats: M, M:S, H:M:S, D-H,
    D-H:M, D-H:M:S, UNLIMITED/infinite. Raises ValueError otherwise."""
    text = slurm_time.strip()
    if text.lower() in ("unlimited", "infinite"):
        return None
    days, dash, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]  # ValueError on garbage
    if any(p < 0 for p in parts) or not 1 <= len(parts) <= 3:
        raise ValueError(slurm_time)
    if dash:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, (parts + [0])[:2]
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def aggregate(states: list[str]) -> str:
    """One state for a het job from its components' states. COMPLETING (ended, SLURM still
    cleaning up, e.g. just after a cancel) only when no component is running any more."""
    states = [s.split()[0] if s else "UNKNOWN" for s in states]  # "CANCELLED by 0" -> CANCELLED
    if not states or all(s == "UNKNOWN" for s in states):
        return "UNKNOWN"
    if all(s == "COMPLETED" for s in states):
        return "COMPLETED"
    if any(s in ACTIVE and s not in ("PENDING", "COMPLETING") for s in states):
        return "RUNNING"
    if "COMPLETING" in states:
        return "COMPLETING"
    if all(s == "PENDING" for s in states):
        return "PENDING"
    for s in FAILED_FIRST:
        if s in states:
            return s
    return states[0]


class HetSlurmJob(SlurmJob):
    """A job of a run: a het job, whose state is the aggregate of its components
    `<id>+<k>`, or a plain job (one group, e.g. SFT) known as `<id>`."""

    watcher = SlurmInfoWatcher(delay_s=60)
    groups: list[str] = list(GROUP_NAMES)  # the job's groups, in het-group order

    def component_ids(self) -> list[str]:
        if len(self.groups) == 1:
            return [str(self.job_id)]
        return [f"{self.job_id}+{k}" for k in range(len(self.groups))]

    def group_states(self, mode: str = "standard") -> dict[str, str]:
        ids = self.component_ids()
        for i in ids:
            if i not in self.watcher._registered:
                self.watcher.register_job(i)
        self.watcher.update_if_long_enough(mode)  # one sacct call for every component
        out = {}
        for i, name in zip(ids, self.groups):
            info = self.watcher.get_info(i, mode="cache")
            out[name] = info.get("State") or "UNKNOWN"
        if all(s == "UNKNOWN" for s in out.values()):
            comps = squeue_components([str(self.job_id)]).get(str(self.job_id), {})
            out.update({self.groups[k]: st for k, st in comps.items() if k < len(self.groups)})
        return out

    @property
    def state(self) -> str:
        return aggregate(list(self.group_states().values()))

    def done(self, force_check: bool = False) -> bool:
        state = aggregate(list(self.group_states(mode="force" if force_check else "standard").values()))
        return state not in ACTIVE and state != "UNKNOWN"


class SlurmUnreachable(RuntimeError):
    """squeue/sacct could not answer (controller or accounting down); says which."""


def _ask(cmd: list[str]) -> str:
    """stdout of a SLURM query; `SlurmUnreachable` when it could not be answered (an
    unknown job id is an answer: no lines)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmUnreachable(f"{cmd[0]}: {e}") from None
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        raise SlurmUnreachable(f"{cmd[0]}: {_last_error(cmd[0], out.stderr) or f'exit code {out.returncode}'}")
    return out.stdout


def _last_error(tool: str, stderr: str) -> str:
    """The last line of a SLURM tool's complaint without its "<tool>: error: " prefix
    (sacct, say, writes several lines; the last one names the cause)."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    for prefix in (f"{tool}: ", "error: "):
        if last.startswith(prefix):
            last = last[len(prefix):]
    return last[:200]


def _components(cmd: list[str], strict: bool = False) -> dict[str, dict[int, str]]:
    """{leader id: {het group index: state}} from squeue/sacct lines "<id>+<k>|<state>"
    (a plain job's line "<id>|<state>" is its group 0). With `strict`, an unanswered
    query raises `SlurmUnreachable`; otherwise it counts as no lines."""
    try:
        out = _ask(cmd)
    except SlurmUnreachable:
        if strict:
            raise
        return {}
    found: dict[str, dict[int, str]] = {}
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        leader, plus, k = jid.partition("+")
        if plus and k.isdigit():
            found.setdefault(leader, {})[int(k)] = state
        elif not plus and leader.isdigit():
            found.setdefault(leader, {})[0] = state
    return found


def squeue_components(job_ids: list[str], finished_too: bool = False) -> dict[str, dict[int, str]]:
    """Component states the controller knows (queued and running; with `finished_too`,
    also jobs that ended in the last MinJobAge seconds)."""
    cmd = ["squeue", "-h", "-o", "%i|%T", "-j", ",".join(job_ids)] + (["-t", "all"] if finished_too else [])
    return _components(cmd)


def component_states(job_id: str, groups: list[str]) -> dict[str, str]:
    """{group name: state} of one job: squeue while the controller knows it, else sacct.
    Raises `SlurmUnreachable` when neither can answer."""
    found = _components(["squeue", "-h", "-o", "%i|%T", "-t", "all", "-j", job_id], strict=True).get(job_id)
    if not found:
        found = _components(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id], strict=True).get(job_id)
    return {groups[k]: st for k, st in (found or {}).items() if k < len(groups)}


def live_states(groups: dict[str, int]) -> tuple[dict[str, str], Optional[str]]:
    """({job id: aggregated state}, note) for {job id: number of groups}: squeue for what
    the controller still knows, sacct for the rest, and only once it lists every component
    (early on it shows one row). The note says what could not be asked (those jobs are
    left out)."""
    job_ids = list(groups)
    note = None
    try:
        found = _components(["squeue", "-h", "-o", "%i|%T", "-t", "all", "-j", ",".join(job_ids)], strict=True)
    except SlurmUnreachable as e:
        found, note = {}, str(e)
    rest = [j for j in job_ids if j not in found]
    if rest:
        try:
            found.update(_components(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(rest)],
                                     strict=True))
        except SlurmUnreachable as e:
            note = "; ".join(filter(None, [note, str(e)]))
    return {j: aggregate(list(s.values())) for j, s in found.items() if j in groups and len(s) >= groups[j]}, note


class HetSlurmExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor with our het-job script in place of its sbatch string."""

    job_class = HetSlurmJob

    def __init__(self, plan: Plan) -> None:
        super().__init__(folder=plan.run.submitit_dir, max_num_timeout=3, python=shlex.quote(plan.python))
        self.plan = plan
        self.parameters["time"] = minutes(plan.time) or 60 * 24 * 365

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(self.plan)

    def _num_tasks(self) -> int:
        return 1  # the head task; the other groups are srun steps of the script


def submit(plan: Plan, task: Any) -> HetSlurmJob:
    """Submit the het job running `task` on the head group; returns at once."""
    if not _have_slurm():
        raise LaunchError("cluster.backend=slurm but no SLURM here (sbatch not found); use cluster=local "
                          "or start the dev cluster: tools/dev-cluster start")
    executor = HetSlurmExecutor(plan)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # sbatch's complaint is re-raised as one line
            job = executor.submit(task)
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as e:
        detail = " ".join(str(e).split())
        raise LaunchError(f"sbatch refused the job: {detail[-400:]}") from None
    job.groups = plan.group_names  # type: ignore[attr-defined]
    return job  # type: ignore[return-value]


def job(job_id: str, plan_folder: str, groups: Optional[list[str]] = None) -> HetSlurmJob:
    j = HetSlurmJob(folder=plan_folder, job_id=job_id, tasks=[0])
    j.groups = list(groups or GROUP_NAMES)
    return j


def cancel(job_id: str) -> None:
    out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise LaunchError(f"scancel {job_id} failed: {out.stderr.strip()}")


def _have_slurm() -> bool:
    import shutil

    return shutil.which("sbatch") is not None
