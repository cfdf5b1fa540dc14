"""The one place that turns `cluster.device` (cpu | cuda) into backends.

Components never test for CUDA themselves: they ask here for the torch.distributed
backend, the torch device of a local rank and the environment the inference engine needs.
Importing this module is cheap (torch is imported inside the functions).
"""
from __future__ import annotations

import os
from typing import Any, Optional

DEVICES = ("cpu", "cuda")


def _check(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
    return device


def current() -> str:
    """The device the launcher chose for this run (exported to every component)."""
    return _check(os.environ.get("PRIME_HPC_DEVICE", "cpu"))


def dist_backend(device: str) -> str:
    """torch.distributed backend: NCCL on GPUs, gloo on CPU."""
    return "nccl" if _check(device) == "cuda" else "gloo"


def torch_device(device: str, local_rank: int = 0) -> Any:
    """The torch device a rank computes on (cuda:<local_rank> or cpu); selects it on GPU."""
    import torch

    if _check(device) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def inference_env(device: str, kvcache_space_gb: Optional[float] = None, threads: Optional[int] = None) -> dict[str, str]:
    """Environment variables the vLLM engine needs on this device (none on GPU)."""
    if _check(device) == "cuda":
        return {}
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    if kvcache_space_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache_space_gb)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
