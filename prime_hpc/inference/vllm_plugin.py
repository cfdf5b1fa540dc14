"""A vLLM general plugin (entry point group `vllm.general_plugins`), loaded by vLLM in each
of its processes: the API server, the engine core and every worker.

What it changes, only when the variable is set (`prime_hpc.core.device.inference_env` sets it
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

- `PRIME_HPC_VLLM_FORK=1`: the API server forks its engine process instead of spawning
  it (vLLM's CPU platform always spawns). The fork inherits vLLM and torch already
  imported, ~10 s of a server's start on 2 CPU cores; the API server has run no OpenMP
  work by then, so the child's thread pools start clean. Not set on GPUs (CUDA needs
  spawn once initialised, and vLLM decides that itself there).

Always: the weight-transfer backend `gloo` (`prime_hpc.inference.transfer`, imported only
by a worker of a server started with it: `weights.transport=broadcast` on CPU).

Importing this module imports no vLLM; `register()` does.
"""

from __future__ import annotations

import os

SPIN_VAR = "PRIME_HPC_VLLM_SPIN_S"
SERVER_PID_VAR = "PRIME_HPC_SERVER_PID"
RECHECK_MS = 10
SPIN_ATTR = "_prime_hpc_spin_s"  # the spin bound kept on vLLM's SpinCondition class
FORK_VAR = "PRIME_HPC_VLLM_FORK"
GLOO_BACKEND = "gloo"  # the weight-transfer backend name (`core.device.weight_transfer_backend`)


def _fork_engine() -> None:
    """Start the engine process by fork instead of spawn (vLLM's CPU platform forces spawn).
    A forked child loads no plugin (vLLM's loaded-once flag is inherited), so it asks for
    its parent-death signal at the fork itself."""
    from vllm.platforms import cpu

    from prime_hpc.runtime.stopping import die_with_parent

    os.register_at_fork(after_in_child=die_with_parent)

    platform = cpu.CpuPlatform
    original = getattr(platform.check_and_update_config, "__func__")  # the classmethod's function

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    setattr(platform, "check_and_update_config", classmethod(check_and_update_config))


def _register_weight_transfer() -> None:
    """Our CPU weight-transfer engine, by module path (imported when a worker creates it);
    once per process (vLLM refuses a name registered twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "prime_hpc.inference.transfer", "GlooWeightTransferEngine"
        )


def register() -> None:
    _register_weight_transfer()
    server = os.environ.get(SERVER_PID_VAR, "")
    if server.isdigit() and int(server) != os.getpid():
        from prime_hpc.runtime.stopping import die_with_parent

        die_with_parent()
    if os.environ.get(FORK_VAR) == "1" and server == str(os.getpid()):
        _fork_engine()
    value = os.environ.get(SPIN_VAR)
    if value is None:
        return
    spin_s = float(value)
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)
    cls = shm_broadcast.SpinCondition
    if getattr(cls, SPIN_ATTR, None) is not None:
        setattr(cls, SPIN_ATTR, spin_s)
        return
    original = cls.wait

    def wait(self, timeout_ms=None):
        # applies to queues created before the plugin was loaded too
        self.busy_loop_s = min(self.busy_loop_s, getattr(cls, SPIN_ATTR))
        return original(self, timeout_ms)

    setattr(cls, SPIN_ATTR, spin_s)
    setattr(cls, "wait", wait)
