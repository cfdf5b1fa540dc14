"""What the launcher tells every process of a job through its environment, read in one
place. The job scripts (sbatch_templates/) and the local launcher set these variables;
components read them here and nowhere else.

- `PRIME_HPC_LOGS`: this attempt's log directory (`<output_dir>/logs/attempt_<n>`);
- `PRIME_HPC_NODE_RANK`: the node's index within its group, set per inference server
  (each server is a SLURM step of its own, where `SLURM_NODEID` is 0) and read before
  `SLURM_NODEID`;
- `PRIME_HPC_INFERENCE_SLOT`: an inference server's slot when it is not `inference_<node
  rank>` (a server of another job of the run: `inference_<jobid>.<n>`);
- `PRIME_HPC_HET_GROUP`: the het group an inference server's step runs in (its step is
  addressed by that component's own job id, `SLURM_JOB_ID_HET_GROUP_<g>`);
- `PRIME_HPC_DEVICE`: `cpu` or `cuda`, the run's device (`cluster.device`);
- `PRIME_HPC_CACHE`: the run's shared cache (`cluster.cache_dir`: built models, compile
  caches); also honoured outside a job;
- `INFERENCE_SERVER_API_KEY`: the key every inference server of the job demands (the
  user's, or one the launcher made for the job); in no file of the run but the one kept
  for its owner alone (`private/api_key`, `prime_hpc.core.keyfile`), never sent to a
  server by the run's router or relay (`prime_hpc.inference.gate.Proofs`);
- `PRIME_HPC_PG_STORE`: when every node is this machine, the file where the trainer's
  ranks set up their process group (torch's TCP store would listen on every interface).

And one word back: `STALLED`, the exit code of the job's watchdog when it found a stall,
which the job script tells from its other ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

LOGS_VAR = "PRIME_HPC_LOGS"
NODE_RANK_VAR = "PRIME_HPC_NODE_RANK"
SLOT_VAR = "PRIME_HPC_INFERENCE_SLOT"
HET_GROUP_VAR = "PRIME_HPC_HET_GROUP"
DEVICE_VAR = "PRIME_HPC_DEVICE"
CACHE_VAR = "PRIME_HPC_CACHE"
API_KEY_VAR = "INFERENCE_SERVER_API_KEY"
PG_STORE_VAR = "PRIME_HPC_PG_STORE"
ENV_POLICY_KEY_VAR = "PRIME_HPC_ENV_POLICY_KEY"  # an env server's policy endpoint's key where it is not the router's
STALLED = 3  # the watchdog's exit code for a stall


def require_key(prog: str, who: str) -> Optional[str]:
    """The job's key (`INFERENCE_SERVER_API_KEY`) for a process that must not listen
    without it. When it is missing, says so in one line on stderr (`<prog>: ... <who> never
    serves without the job's key ...`) and returns None: the caller exits with code 2."""
    key = os.environ.get(API_KEY_VAR)
    if not key:
        print(
            f"{prog}: {API_KEY_VAR} is not set: {who} never serves without the job's key "
            "(the job's environment must carry it)",
            file=sys.stderr,
            flush=True,
        )
    return key or None


def logs_dir() -> Optional[Path]:
    """This attempt's log directory, if the process runs inside a job."""
    value = os.environ.get(LOGS_VAR)
    return Path(value) if value else None


def node_rank() -> int:
    """This node's index within its group (0 outside a job)."""
    for var in (NODE_RANK_VAR, "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def slot() -> Optional[str]:
    """This inference server's slot, when the launcher named it (else it is derived from
    the node rank: `rundir.server_slot`)."""
    return os.environ.get(SLOT_VAR) or None


def slurm_step() -> Optional[str]:
    """`<job id>.<step id>` of the SLURM step this process runs in (None outside one): what
    `scancel --signal` addresses. A step of a het job's component g belongs to that
    component's own job id (`SLURM_JOB_ID_HET_GROUP_<g>`; `SLURM_JOB_ID` is the leader's)."""
    group = os.environ.get(HET_GROUP_VAR)
    job = (os.environ.get(f"SLURM_JOB_ID_HET_GROUP_{group}") if group else None) or os.environ.get("SLURM_JOB_ID")
    step = os.environ.get("SLURM_STEP_ID")
    return f"{job}.{step}" if job and step else None


def device() -> str:
    """The run's device, as the launcher chose it (`cluster.device`); only inside a job."""
    value = os.environ.get(DEVICE_VAR)
    if not value:
        raise RuntimeError(f"{DEVICE_VAR} is not set: this runs inside a prime-hpc job, whose launcher sets it")
    return value


def cache_dir() -> Optional[Path]:
    """The shared cache directory, if one is set."""
    value = os.environ.get(CACHE_VAR)
    return Path(value) if value else None


def process_group_init() -> dict:
    """`torch.distributed.init_process_group`'s rendezvous arguments for a rank started by
    torchrun: a file store when the job says so (`PRIME_HPC_PG_STORE`), else torchrun's
    environment (`env://`)."""
    path = os.environ.get(PG_STORE_VAR)
    if not path:
        return {}
    return {
        "init_method": "file://" + path,
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


@contextlib.contextmanager
def job_api_key(key: str) -> Iterator[None]:
    """`key` in this process's environment while the job is submitted: it reaches the job
    only through the environment sbatch (or the local script) inherits from it."""
    if os.environ.get(API_KEY_VAR) == key:
        yield
        return
    os.environ[API_KEY_VAR] = key
    try:
        yield
    finally:
        os.environ.pop(API_KEY_VAR, None)
