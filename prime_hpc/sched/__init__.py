"""Backends: whatever runs prime-hpc's jobs, behind one protocol (`base.Backend`: submit,
cancel, state, alive, batch log, requeue, stop cause). `choose` is the one place a
backend's name becomes its class; a new scheduler is one new class listed here.

Placed low (above `rundir` and `core`, below `config`, `watch`, `job` and `launcher`) so
that the launcher, the job script's helpers and the read-only views all ask the same
object."""

from __future__ import annotations

from typing import Any

from prime_hpc.core.errors import UserError
from prime_hpc.sched.base import Backend, JobSpec
from prime_hpc.sched.local import Local
from prime_hpc.sched.slurm import Slurm

_CLASSES: dict[str, type[Backend]] = {cls.name: cls for cls in (Local, Slurm)}
BACKENDS = tuple(_CLASSES)  # the choices of `cluster.backend`


class UnknownBackend(UserError):
    """A backend name (cluster.backend, job.json's backend) that no class answers to."""


def choose(name: Any) -> Backend:
    """The backend called `name`."""
    cls = _CLASSES.get(str(name))
    if cls is None:
        raise UnknownBackend(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return cls()


def of(job: dict[str, Any]) -> Backend:
    """The backend a job.json records as running the job."""
    if "backend" not in job:
        raise UnknownBackend(
            f"job.json of {job.get('output_dir', 'this run')} records no backend (one of {', '.join(BACKENDS)})"
        )
    return choose(job["backend"])


__all__ = ["BACKENDS", "Backend", "JobSpec", "UnknownBackend", "choose", "of"]
