"""The worker side of `weights.transport=broadcast` on CPU: a vLLM weight-transfer engine
(backend `gloo`, registered by `prime_hpc.inference.vllm_plugin.register`) that receives a
policy over a gloo process group and loads it in place.

Loaded by vLLM in each of its workers when the server was started with
`--weight-transfer-config '{"backend": "gloo"}'` (`prime_hpc.core.device.
weight_transfer_backend`); it imports vLLM, so nothing else imports it. The sender is
`prime_hpc.inference.broadcast.Broadcaster`, rank 0 of the group; the group meets in the
sender's file store (`store_path`, in the run's private `rendezvous/`) when both are on
one host, else in its TCP store (`master_address`, `master_port`). A worker's rank is its
index among the server's workers plus `rank_offset`.

The lifecycle, each step a `collective_rpc` from the server's routes:
  init_transfer_engine  join the group (blocks until every rank has joined)
  start_weight_update   the layers go back to the meta device (vLLM's layerwise reload)
  update_weights        per announced tensor: receive it (`broadcast` from rank 0), check it
                        against its digest (`digests`, from the sender over the keyed
                        route), load it; the next one is received while one is loaded. A
                        tensor that differs from its digest: every tensor is still received
                        (the group stays in step) and the layers are finished, then it
                        raises `DIGEST_MISMATCH` naming the first one: the server never
                        serves what came, it loads the step from the sender's files
  finish_weight_update  the layers' kernels are rebuilt from what was loaded
  shutdown              leave the group
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
from vllm.distributed.utils import (
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from prime_hpc.inference.broadcast import DIGEST_MISMATCH, file_store_prefix, tensor_digest

DEFAULT_TIMEOUT_S = 600.0
HASH_THREADS = min(4, os.cpu_count() or 1)  # a worker's threads checking received tensors against their digests
HASH_AHEAD = 32  # received tensors whose digest may still be under way


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Where the sender's group is and this server's place in it."""

    master_address: str = ""
    master_port: int = 0
    store_path: str = ""
    """the sender's file store (one host), in place of `master_address`/`master_port`"""
    world_size: int
    """the sender and every worker of the servers in the group"""
    rank_offset: int
    """the group rank of this server's first worker (1 when the group is one server's)"""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """longest a join or one tensor's receive waits for the sender"""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, NCCLWeightTransferUpdateInfo]):
    """Receives (name, tensor) pairs in the announced order (names, dtype names, shapes:
    vLLM's dense update info) and loads each through the model's checkpoint loader."""

    init_info_cls = GlooInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Optional[Any] = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        timeout = timedelta(seconds=init_info.timeout_s)
        if init_info.store_path:
            self.group = _file_group(init_info.store_path, rank, init_info.world_size, timeout)
            return
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            backend="gloo",
            timeout=timeout,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class also synchronizes the accelerator, which raises on CPU; a gloo
        # broadcast has completed once `wait` returns
        info = dict(update_info)
        digests = info.pop("digests", None)
        if not isinstance(digests, list) or len(digests) != len(info.get("names") or ()):
            raise RuntimeError("no digest for each tensor: a policy is received only with the sender's digests")
        differs = self._receive(self.parse_update_info(info), digests)
        if differs is not None:
            # the layers are made whole again (with what came, never served: the server
            # keeps generation paused and loads the step from the sender's files)
            self.finish_weight_update()
            raise RuntimeError(f"{DIGEST_MISMATCH}: {differs}")

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        self._receive(update_info, None)

    def _receive(self, update_info: NCCLWeightTransferUpdateInfo, digests: Optional[list]) -> Optional[str]:
        """Receive and load every announced tensor; with `digests`, check each one first:
        what differs (the first tensor), or None."""
        if self.group is None:
            raise RuntimeError("no weight group: the sender has not joined (init_weight_transfer_engine)")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        model: Any = self.model  # a vLLM model: `load_weights` takes checkpoint-named tensors
        group = self.group
        specs = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        check = DigestCheck(digests) if digests is not None else None

        def receive(i: int) -> tuple[str, Any, Any]:
            name, dtype_name, shape = specs[i]
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            return name, weight, group.broadcast(weight, 0)

        def received() -> Iterator[tuple[str, Any]]:
            """Each tensor once it has arrived; the next one arrives (in gloo's thread) while
            this one is loaded."""
            pending = receive(0) if specs else None
            for i in range(len(specs)):
                assert pending is not None
                name, weight, work = pending
                work.wait()
                pending = receive(i + 1) if i + 1 < len(specs) else None
                if check is not None:
                    check.add(i, name, weight)
                yield name, weight

        # one call for the whole policy, as a load from disk: the model's loader maps the
        # checkpoint's names onto its (fused) parameters once, not once per tensor
        try:
            with disable_mtp_completeness_check():
                model.load_weights(received())
        finally:
            differs = check.result() if check is not None else None
        return f"tensor {differs!r} differs from the digest its sender gave" if differs else None

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            stateless_destroy_torch_distributed_process_group(group)


class DigestCheck:
    """Each received tensor's digest against the sender's, hashed on `HASH_THREADS` threads
    (hashlib lets go of the GIL) while the next tensors arrive and load; at most
    `HASH_AHEAD` tensors wait for theirs (their memory is held until then)."""

    def __init__(self, digests: list) -> None:
        self.digests = digests
        self.pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="prime-hpc-digest")
        self.pending: deque = deque()
        self.differs: Optional[str] = None  # the first tensor whose digest differs

    def add(self, i: int, name: str, tensor: Any) -> None:
        self.pending.append((i, name, self.pool.submit(tensor_digest, tensor)))
        while len(self.pending) > HASH_AHEAD:
            self._settle()

    def _settle(self) -> None:
        i, name, digest = self.pending.popleft()
        if digest.result() != self.digests[i] and self.differs is None:
            self.differs = name

    def result(self) -> Optional[str]:
        """The first tensor (in the order sent) that differs from its digest, or None."""
        try:
            while self.pending:
                self._settle()
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
        return self.differs


def _file_group(path: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    """This worker's side of a group that meets in the sender's file store (one host:
    nothing listens for the rendezvous), built as vLLM builds its stateless gloo groups."""
    from torch.distributed import FileStore, PrefixStore
    from vllm.distributed.utils import init_gloo_process_group

    store = FileStore(path, world_size)
    store.set_timeout(timeout)
    return init_gloo_process_group(PrefixStore(file_store_prefix(path), store), rank, world_size, timeout)
