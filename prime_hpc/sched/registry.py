"""The one place a backend's name (`cluster.backend`, job.json's `backend`) becomes its
class: `choose(name)`, `of(job_json)`. Apart from the backends so that they, and the
protocol they implement (`base`), never import each other in a circle."""

from __future__ import annotations

from typing import Any

from prime_hpc.core.errors import UserError
from prime_hpc.sched import BACKENDS
from prime_hpc.sched.base import Backend
from prime_hpc.sched.local import Local
from prime_hpc.sched.slurm import Slurm


class UnknownBackend(UserError):
    """A backend name (cluster.backend, job.json's backend) that no class answers to."""


def _classes() -> dict[str, type[Backend]]:
    return {cls.name: cls for cls in (Local, Slurm)}


def choose(name: Any) -> Backend:
    """The backend called `name`: the one place a backend's name becomes its class."""
    cls = _classes().get(str(name))
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
