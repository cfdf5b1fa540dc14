"""The worker side of `weights.transport=broadcast` on CPU: a vLLM weight-transfer engine
(backend `gloo`, registered by `prime_hpc.inference.vllm_plugin.register`) that receives a
policy over a gloo process group and loads it in place.

Loaded by vLLM in each of its workers when the server was started with
`--weight-transfer-config '{"backend": "gloo"}'` (`prime_hpc.core.device.
weight_transfer_backend`); it imports vLLM, so nothing else imports it. The sender is
`prime_hpc.inference.broadcast.Broadcaster`, rank 0 of the group and the master of its
TCP store; a worker's rank is its index among the server's workers plus `rank_offset`.

The lifecycle, each step a `collective_rpc` from the server's routes:
  init_transfer_engine  join the group (blocks until every rank has joined)
  start_weight_update   the layers go back to the meta device (vLLM's layerwise reload)
  update_weights        per announced tensor: receive it (`broadcast` from rank 0), load it;
                        the next one is received while one is loaded
  finish_weight_update  the layers' kernels are rebuilt from what was loaded
  shutdown              leave the group
"""

from __future__ import annotations

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

DEFAULT_TIMEOUT_S = 600.0


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Where the sender's group is and this server's place in it."""

    master_address: str
    master_port: int
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
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            backend="gloo",
            timeout=timedelta(seconds=init_info.timeout_s),
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
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("no weight group: the sender has not joined (init_weight_transfer_engine)")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        model: Any = self.model  # a vLLM model: `load_weights` takes checkpoint-named tensors
        group = self.group
        specs = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))

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
                yield name, weight

        # one call for the whole policy, as a load from disk: the model's loader maps the
        # checkpoint's names onto its (fused) parameters once, not once per tensor
        with disable_mtp_completeness_check():
            model.load_weights(received())

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            stateless_destroy_torch_distributed_process_group(group)
