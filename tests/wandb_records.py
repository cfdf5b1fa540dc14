"""Read the history of an offline W&B run (`run-<id>.wandb`): the file is a sequence of
protobuf `Record`s in LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte
header: crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4) after a 7-byte W&B header."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

BLOCK = 32768


def _chunks(data: bytes) -> Iterator[bytes]:
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def history_keys(path: Path) -> list[set[str]]:
    """The keys of every history row logged to the offline run file at `path`."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in _chunks(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key) for item in rec.history.item})
    return rows
