"""The backend protocol: what prime-hpc asks of whatever runs its jobs (SLURM, or this
machine). One class per backend (`prime_hpc.sched.slurm.Slurm`, `prime_hpc.sched.local.Local`);
`prime_hpc.sched.registry.choose` is the one place a backend's name (`cluster.backend`, job.json's
`backend`) becomes its class. Nothing outside this package tells backends apart by name.

Light: `status`, `list`, `tail`, `cancel` and the job script's helpers (`prime_hpc.job.attempt`)
use it, so it imports no config, no submitit (the SLURM backend imports it inside `submit`)
and nothing of the launcher. Job ids are opaque: which backend runs a job is what its
job.json records, never something read off the id."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from prime_hpc.rundir import RunDir
from prime_hpc.rundir.jobs import CANCELLED


@dataclass
class JobSpec:
    """A job the launcher prepared and rendered, for a backend to start."""

    run: RunDir
    kind: str  # rl | sft: which of the run's scripts (submit/<kind>.sbatch, submit/<kind>.local.sh)
    task: Any  # what the head group runs: a picklable callable (submitit runs it) with `.argv(python)`
    time_min: int  # the job's time limit, in minutes
    shell_script: Callable[[str], str]  # the job as a script of this machine, given its job id


class Backend(abc.ABC):
    """Submit, ask about and stop the jobs of one kind of scheduler. Stateless: every
    answer comes from the run directory (`job.json`) and the scheduler itself."""

    name: ClassVar[str]  # as `cluster.backend` and job.json's `backend` spell it
    job_env: ClassVar[dict[str, str]] = {}  # exported by every job script this backend runs
    one_machine: ClassVar[bool] = False  # every group of a job runs on the submitting machine
    requeues: ClassVar[bool] = False  # can put a job back in its queue (time limit, preemption)
    extra_jobs: ClassVar[bool] = False  # can run extra inference jobs beside a running run (`scale`)

    # --- submit time (the launcher)
    @abc.abstractmethod
    def submit(self, job: JobSpec) -> tuple[str, dict[str, Any]]:
        """Start `job` and return at once: its id, and what job.json records of it besides
        (the local backend: the supervising script's pid)."""

    def submit_script(self, script: Path) -> str:
        """Submit a plain job script of this backend as it is (an extra inference job: one
        task per node, nothing for submitit to run); its id. Only where `extra_jobs`."""
        raise NotImplementedError(f"{self.name} runs take no extra inference jobs")

    def signal_script(self, job_id: str, signal_name: str) -> bool:
        """Send `signal_name` (e.g. USR2) to the job's script alone, not to its steps;
        False when that cannot be done (the job is not running). Only where `extra_jobs`."""
        return False

    def plain_states(self, job_ids: list[str]) -> tuple[dict[str, str], str]:
        """{job id: state} of plain (one-group) jobs of this backend, asked at once, and a
        note naming what could not be asked (those are left out). Only where `extra_jobs`."""
        return {}, ""

    @abc.abstractmethod
    def cancel(self, run: RunDir, job_id: str) -> None:
        """Stop every group of the job (the caller has recorded the cancel in job.json)."""

    # --- what a job is doing (light: the read-only commands)
    @abc.abstractmethod
    def group_states(self, run: RunDir, job_id: str) -> tuple[dict[str, str], Optional[str]]:
        """{group: state} of the job, in het-group order, and a note when the scheduler
        could not be asked (then the states are what job.json recorded)."""

    def overall(self, states: dict[str, str]) -> str:
        """One state for the job from its groups' (here: they share the job's)."""
        return next(iter(states.values()), "UNKNOWN")

    def state(self, run: RunDir, job_id: str) -> str:
        return self.overall(self.group_states(run, job_id)[0])

    def states(self, records: dict[str, dict[str, Any]]) -> tuple[dict[str, str], str]:
        """{job id: state} of several jobs ({job id: its job.json}) at once, and a note
        naming what could not be asked (those jobs are left out)."""
        return {j: self.state(RunDir(rec["output_dir"]), j) for j, rec in records.items()}, ""

    @abc.abstractmethod
    def alive(self, run: RunDir, job_id: str) -> bool:
        """The job is queued, running, or still stopping after a cancel."""

    @abc.abstractmethod
    def batch_log(self, run: RunDir, job_id: str) -> Path:
        """The job script's own output (what to read before any component log exists)."""

    # --- inside the job (prime_hpc.job.attempt)
    def requeue(self, job_id: str) -> str:
        """Put the job back in the queue (only where `requeues`); '' on success, else why not."""
        return f"{self.name} runs are not requeued"

    def requeued(self, job_id: str) -> None:
        """The scheduler requeued the job itself (`scontrol requeue`, a node that failed):
        let it start again soon (where a backend requeues at all)."""
        return None

    def stop_cause(self, run: RunDir, job_id: str) -> str:
        """Why the job is being stopped: CANCELLED, or where the scheduler says so
        TIMEOUT, PREEMPTED or REQUEUED."""
        return CANCELLED

    def down_nodes(self, job_id: str) -> list[str]:
        """The job's nodes the scheduler holds as failed (down, drained, not responding):
        a component that died with one ends the attempt, which is requeued. This machine
        does not fail apart from the job."""
        return []

    def stop_leftovers(self, job_id: str) -> tuple[list[str], list[str]]:
        """A requeued job starts again: stop what an earlier attempt of it still runs, where
        the scheduler leaves it running, before anything of this attempt starts; returns
        (what was found, what could not be stopped). Nothing of a local attempt outlives
        its script."""
        return [], []
