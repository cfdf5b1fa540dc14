"""What a component's exit code does not say: that a process of it was killed by a signal
(torchrun's report of a rank, or the exit code 128 + N of a process killed by N), and, for
SIGKILL, whether it was the out-of-memory killer (SLURM says so when it counts the kill in
the step's cgroup; the kernel's OOM killer sends SIGKILL with no other trace a job can
read).

Pure text over the tails of the component's logs; `attempt.end` adds the result to the
failure's reason.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Iterable, Optional

from prime_hpc.rundir import read_tail

TAIL_BYTES = 64 * 1024  # torchrun's report and srun's last words are at the end of their logs

# torchrun's ChildFailedError report: the block after "Root Cause (first observed failure):"
ROOT_CAUSE = "Root Cause (first observed failure)"
RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)
# slurmstepd: "Detected 1 oom_kill event in StepId=12.2. Some of the step tasks have been OOM
# Killed." (older: "Detected 1 oom-kill event(s) in step 12.batch cgroup"); srun: "srun:
# error: node1: task 0: Out Of Memory". SLURM's words only: a Python error's "CUDA out of
# memory" is an exception, not a kill
OOM = re.compile(r"oom[-_]kill event|OOM Killed|tasks? [\d-]+: Out Of Memory")

OOM_HINT = "out of memory? (the kernel's out-of-memory killer sends SIGKILL; so does a kill -9)"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def killed_rank(text: str) -> Optional[tuple[int, int]]:
    """(rank, signal) of torchrun's first observed failure when a signal ended it (its
    exitcode is minus the signal's number), from a log holding torchrun's report."""
    at = text.rfind(ROOT_CAUSE)
    if at < 0:
        return None
    block = text[at:]
    rank, code = RANK.search(block), EXITCODE.search(block)
    if not rank or not code or int(code.group(1)) >= 0:
        return None
    return int(rank.group(1)), -int(code.group(1))


def oom_line(texts: Iterable[str]) -> Optional[str]:
    """The last line of SLURM's saying the step's tasks were killed out of memory."""
    for text in texts:
        for line in reversed(text.splitlines()):
            if OOM.search(line):
                return line.strip()
    return None


def cause(rc: Optional[int], logs: Iterable[Path]) -> str:
    """One clause on how the component's process was killed ("" when it was not, as far
    as its exit code and `logs` tell): "rank 1 was killed by SIGKILL: out of memory
    (slurmstepd: ...)", "killed by SIGSEGV", ..."""
    texts = [read_tail(p, TAIL_BYTES)[1].decode(errors="replace") for p in logs]
    who, number = "", None
    for text in texts:
        found = killed_rank(text)
        if found:
            who, number = f"rank {found[0]} was ", found[1]
            break
    if number is None and rc is not None and rc > 128:
        number = rc - 128  # a shell's or srun's exit code of a process killed by a signal
    if number is None:
        return ""
    what = f"{who}killed by {signal_name(number)}"
    if number != signal.SIGKILL:
        return what
    line = oom_line(texts)
    return f"{what}: out of memory ({line})" if line else f"{what}: {OOM_HINT}"
