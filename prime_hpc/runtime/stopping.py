"""How a component learns that it must stop, and whether to checkpoint first.

Two sources:
- SIGTERM: a cancel, or SLURM ending the job for a time limit, a preemption or a requeue
  (every process of the job gets it at the same moment; a preemption with a grace time
  signals only the components, so each one that gets it leaves a marker,
  `control/sigterm_<host>_<pid>`, for the supervisor to notice);
- the supervisor's request `control/checkpoint.json` (run directory): written when SLURM
  warns that the time limit is near, and right after a SIGTERM whose cause is a time
  limit, a preemption or a requeue (the supervisor asks SLURM why).

A component asks at its safe points (between steps, while waiting) and gets CONTINUE,
CHECKPOINT (save the step you are at, then exit: the next attempt continues from there) or
EXIT (stop now: a cancel). After a SIGTERM without a request, the answer waits up to
`DECIDE_S` for one, the time the supervisor needs to ask SLURM. The codes are ordered so
that data-parallel ranks agree by taking the maximum.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import NoReturn, Optional

from prime_hpc.rundir import RunDir, exists_fresh, read_json

CONTINUE, EXIT, CHECKPOINT = 0, 1, 2
DECIDE_S = 5.0  # after SIGTERM: how long to wait for the supervisor's checkpoint request


class Stop:
    """`control`: where the supervisor's request is, when not in `run` (a run of a job of
    several runs reads its job's: one request for every run)."""

    def __init__(self, run: RunDir, handle_sigterm: bool = True, control: Optional[RunDir] = None) -> None:
        self.run = control or run
        self.terminated_at: Optional[float] = None
        if handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: object) -> None:
        if self.terminated_at is None:
            self.terminated_at = time.monotonic()
            try:  # the supervisor may not have been signalled itself (a preemption's grace time)
                self.run.sigterm_marker(f"{socket.gethostname()}_{os.getpid()}").touch()
            except OSError:
                pass

    def requested(self) -> bool:
        """Did the supervisor ask for a checkpoint?"""
        return exists_fresh(self.run.checkpoint_request)

    def pending(self) -> bool:
        """Something asks this component to stop (decided or not yet)."""
        return self.terminated_at is not None or self.requested()

    def poll(self) -> int:
        """The decision if there is one now (CONTINUE while a SIGTERM is undecided)."""
        if self.requested():
            return CHECKPOINT
        if self.terminated_at is not None and time.monotonic() - self.terminated_at >= DECIDE_S:
            return EXIT
        return CONTINUE

    def decision(self) -> int:
        """CONTINUE, EXIT or CHECKPOINT; blocks at most `DECIDE_S` after a SIGTERM."""
        while True:
            got = self.poll()
            if got != CONTINUE or self.terminated_at is None:
                return got
            time.sleep(0.1)

    def reason(self) -> str:
        try:
            return str(read_json(self.run.checkpoint_request).get("reason", "stop"))
        except (OSError, ValueError):
            return "SIGTERM"


def checkpointed_step(run: RunDir, job: Optional[RunDir] = None) -> Optional[int]:
    """The step the trainer saved on request (`control/checkpointed.json`), if it did; of a
    run of a job of several runs (`job`), the run's entry in the job's answer
    (`{"runs": {name: step}}`, `prime_hpc.trainer.multirun`)."""
    try:
        if job is not None:
            return int(read_json(job.checkpoint_answer)["runs"][run.root.name])
        return int(read_json(run.checkpoint_answer)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL, parent: Optional[int] = None) -> None:
    """Have the kernel send `sig` to this process when its parent dies, however the parent
    dies (a SIGKILL included). A component's children (vLLM's engine and workers, the
    trainer's ranks under torchrun) then never outlive it, also where SLURM tracks a
    step's processes by parent chain (proctrack/linuxproc) and loses the orphans; and the
    local job script's components never outlive the script (`prime_hpc.job.child`).
    `parent`: the pid the parent must have (default: the parent now); if it is already
    gone, `sig` comes at once. Survives exec. Linux only; elsewhere a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        parent = os.getppid() if parent is None else parent
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)
    except (OSError, AttributeError):
        pass


def leave(code: int) -> NoReturn:
    """End the process with `code` once its work is done: logging's handlers and the
    standard streams flushed, then `os._exit`, without the interpreter's teardown. There,
    objects freed only then can still abort a process whose work ended well (torch's gloo
    threads held by a process group's leftovers: "terminate called without an active
    exception", SIGABRT) or fill its log with extension modules' leak reports (triton's
    nanobind, at every exit of an inference server)."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
