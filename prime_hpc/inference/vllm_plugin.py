"""A vLLM general plugin (entry point group `vllm.general_plugins`), loaded by vLLM in each
of its processes: the API server, the engine core and every worker.

What it changes, only when the variable is set (`prime_hpc.device.inference_env` sets it
on CPU):

- `PRIME_HPC_VLLM_SPIN_S`: how long a process waiting on vLLM's shared-memory message
  queue keeps polling it (yielding the core in a loop) after its last message, before it
  sleeps until notified. vLLM polls for 1 s, which keeps an idle worker on its core for a
  second after every batch of decode steps: on a GPU node that is one host core among
  many, on a CPU node it is the core the trainer or the next generation needs (measured
  in docs/benchmarks.md). A sleeping reader also wakes every `RECHECK_MS` instead of
  vLLM's 5 s: its notification can be lost when two messages follow each other closely
  (vLLM's 1 s of polling hides that; without it a generation stalled for 5 s now and
  then), and a wake-up that finds nothing costs microseconds.

- `PRIME_HPC_SERVER_PID` (set by `prime_hpc.inference` in its own process): every other
  vLLM process (engine core, workers) dies with its parent, so a server that is killed,
  even with SIGKILL, leaves no engine process behind holding memory and cores.

Importing this module imports no vLLM; `register()` does.
"""

from __future__ import annotations

import os

SPIN_VAR = "PRIME_HPC_VLLM_SPIN_S"
SERVER_PID_VAR = "PRIME_HPC_SERVER_PID"
RECHECK_MS = 10


def register() -> None:
    server = os.environ.get(SERVER_PID_VAR, "")
    if server.isdigit() and int(server) != os.getpid():
        from prime_hpc.stopping import die_with_parent

        die_with_parent()
    value = os.environ.get(SPIN_VAR)
    if value is None:
        return
    spin_s = float(value)
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)
    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_prime_hpc_spin_s", None) is not None:
        cls._prime_hpc_spin_s = spin_s
        return
    original = cls.wait

    def wait(self, timeout_ms=None):
        # applies to queues created before the plugin was loaded too
        self.busy_loop_s = min(self.busy_loop_s, cls._prime_hpc_spin_s)
        return original(self, timeout_ms)

    cls._prime_hpc_spin_s = spin_s
    cls.wait = wait
