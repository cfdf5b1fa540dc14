"""The trainer's process group: torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT or a c10d rendezvous), or a one-rank group when started without
torchrun. The backend comes from `prime_hpc.core.device` (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from prime_hpc.core import device as devices
from prime_hpc.core import jobenv
from prime_hpc.core.net import LOOPBACK, free_port


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device_kind: str  # cpu | cuda (the run's `device`)
    device: torch.device
    mesh: Any  # 1-D DeviceMesh over all ranks (FSDP's data-parallel dimension)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@contextlib.contextmanager
def process_group(device_kind: str) -> Iterator[DistEnv]:
    """Initialise the default process group and a device mesh; destroy them on exit."""
    from torch.distributed.device_mesh import init_device_mesh

    if "RANK" not in os.environ:  # plain `python -m ...`: a group of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(free_port(LOOPBACK)))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    dev = devices.torch_device(device_kind, local)
    dist.init_process_group(backend=devices.dist_backend(device_kind), **jobenv.process_group_init())
    try:
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
        yield DistEnv(rank=rank, world_size=world, local_rank=local, device_kind=device_kind, device=dev, mesh=mesh)
    finally:
        dist.destroy_process_group()


def all_reduce_sum(values: list[float] | torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a small vector over ranks (float64 on the compute device), returned on CPU."""
    t = torch.as_tensor(values, dtype=torch.float64).to(env.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def all_reduce_max(values: list[int], env: DistEnv) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def barrier() -> None:
    dist.barrier()
