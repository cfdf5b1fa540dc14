"""Backends: whatever runs prime-hpc's jobs, behind one protocol (`base.Backend`: submit,
cancel, state, alive, batch log, requeue, stop cause), one class each (`slurm.Slurm`,
`local.Local`); `registry.choose` is the one place a backend's name becomes its class.

Placed low (above `rundir` and `core`, below `config`, `watch`, `job` and `launcher`) so
that the launcher, the job script's helpers and the read-only views all ask the same
object. This file imports nothing: the schema takes `BACKENDS` from it without loading
the backends (a composition loads only what its cache key covers)."""

BACKENDS = ("local", "slurm")  # the choices of `cluster.backend`: each the `name` of a class in `registry.choose`
