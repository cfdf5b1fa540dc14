"""Submission to SLURM through submitit: submitit pickles the head task, runs sbatch and
parses the job id; we hand it our het-job script (submitit cannot emit het jobs itself,
submitit issue #1741). Imported only to submit (submitit is not light).

Requeues are the job script's, not submitit's: SLURM's time-limit warning goes to the
batch script (`--signal=B:USR2`), which checkpoints and requeues through
`prime_hpc.job.attempt requeue`, counted against `cluster.max_requeues`. submitit's own
checkpoint-and-requeue handler (and its `max_num_timeout`) never sees that signal."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import submitit

from prime_hpc.core.errors import LaunchError
from prime_hpc.sched.base import JobSpec


class HetSlurmExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor submitting the script the launcher rendered in place of
    its own sbatch string."""

    def __init__(self, job: JobSpec) -> None:
        super().__init__(folder=job.run.submitit_dir)
        self.script = job.run.sbatch_script(job.kind)
        self.parameters["time"] = job.time_min

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script.read_text()

    def _num_tasks(self) -> int:
        return 1  # the head task; the other groups are srun steps of the script

    def _make_submission_command(self, submission_file_path: Any) -> list[str]:
        # The job runs in the submitting environment, which carries the job's key, whatever
        # the site's default (SBATCH_EXPORT=NONE) or the script says: the command line wins.
        return ["sbatch", "--export=ALL", str(submission_file_path)]


def submit(job: JobSpec) -> str:
    """Submit the job; its SLURM job id."""
    executor = HetSlurmExecutor(job)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # sbatch's complaint is re-raised as one line
            submitted = executor.submit(job.task)
    except (submitit.core.utils.FailedSubmissionError, submitit.core.utils.FailedJobError) as e:
        detail = " ".join(str(e).split())
        raise LaunchError(f"sbatch refused the job: {detail[-400:]}") from None
    return str(submitted.job_id)
