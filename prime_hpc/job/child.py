"""`python -m prime_hpc.job.child <script pid> CMD [ARGS...]`: how the local job script
(cluster=local) starts each component. CMD runs in a session of its own (its process group
is what the script stops) and dies with the script: the kernel kills it (SIGKILL,
`PR_SET_PDEATHSIG`) when the script ends, however it ends, `kill -9` included, so a dead
script leaves no component running. A component's own processes follow it the same way
(vLLM's engine and workers, torchrun's ranks, vllm-router). Nothing stays in between: this
process becomes CMD. (On SLURM, the components are steps that SLURM ends with the job.)
"""

from __future__ import annotations

import os
import signal
import sys

from prime_hpc.runtime.stopping import die_with_parent


def main(argv: list[str]) -> None:
    script, cmd = int(argv[0]), argv[1:]
    if os.getpgrp() != os.getpid():
        os.setsid()
    die_with_parent(signal.SIGKILL, parent=script)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
