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
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from prime_hpc.config.validate import minutes
from prime_hpc.core.errors import LaunchError
from prime_hpc.launcher.plan import GROUP_NAMES, Plan
from prime_hpc.launcher.render import render_sbatch
from prime_hpc.launcher.slurm_state import ACTIVE, aggregate, squeue_components  # the light state queries


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

    def _make_submission_command(self, submission_file_path: Any) -> list[str]:
        # The job runs in the submitting environment, which carries the job's key, whatever
        # the site's default (SBATCH_EXPORT=NONE) or the script says: the command line wins.
        return ["sbatch", "--export=ALL", str(submission_file_path)]


def submit(plan: Plan, task: Any) -> HetSlurmJob:
    """Submit the het job running `task` on the head group; returns at once."""
    if not _have_slurm():
        raise LaunchError(
            "cluster.backend=slurm but no SLURM here (sbatch not found); use cluster=local "
            "or start the dev cluster: tools/dev-cluster start"
        )
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
