"""A safetensors file written as it is cast: the trainer's float32 weights go to disk in the
served dtype through one fixed buffer, a chunk at a time, never a full cast copy of the
model in memory (`safetensors.torch.save_file` needs one; at 0.6B the copy alone cost more
than writing the file).

The file is the format's plain layout, which every safetensors reader (vLLM, transformers,
`safetensors.safe_open`) loads: an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range, `__metadata__`) padded with spaces to 8 bytes, then
the tensors' bytes back to back in the order given. Not fsynced unless asked: like every
file of `weights/step_n` (`rundir.files.publish_dir` fsyncs the directories), other nodes
see it once it is closed, and weights lost in a crash are written again from the checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping, Optional

import torch

CHUNK_BYTES = 32 << 20  # the cast buffer
DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def out_dtype(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    """Floating tensors take `dtype` (when given); integer and boolean ones keep theirs."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def header(tensors: Mapping[str, torch.Tensor], dtype: Optional[torch.dtype], metadata: Optional[dict]) -> bytes:
    """The length prefix and the padded JSON header of the file `write` makes."""
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        d = out_dtype(t, dtype)
        if d not in DTYPE_CODES:
            raise ValueError(f"{name}: dtype {d} has no safetensors code")
        n = t.numel() * d.itemsize
        entries[name] = {"dtype": DTYPE_CODES[d], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def write(
    path: os.PathLike | str,
    tensors: Mapping[str, torch.Tensor],
    dtype: Optional[torch.dtype] = None,
    metadata: Optional[dict] = None,
    chunk_bytes: int = CHUNK_BYTES,
    fsync: bool = False,
) -> int:
    """Write `tensors` (CPU; floating ones cast to `dtype`) to `path` as safetensors. A
    tensor already in its file dtype is written from its own memory; one to cast is cast a
    chunk at a time into one reused buffer, which is written before the next chunk. Returns
    the file's size in bytes."""
    head = header(tensors, dtype, metadata)
    buffer = torch.empty(chunk_bytes, dtype=torch.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(head))
        for t in tensors.values():
            src = t.detach()
            if not src.is_contiguous():
                src = src.contiguous()
            src = src.reshape(-1)
            d = out_dtype(t, dtype)
            if d == src.dtype:
                _write_all(fd, _bytes_of(src))
                continue
            per = max(1, chunk_bytes // d.itemsize)
            for a in range(0, src.numel(), per):
                n = min(per, src.numel() - a)
                out = buffer[: n * d.itemsize].view(d)
                out.copy_(src[a : a + n])
                _write_all(fd, _bytes_of(out))
        if fsync:
            os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
