"""Files of the run directory as every writer and reader handles them.

Write discipline: files are written to a temp name in the same directory, fsynced, then
`os.replace`d (atomic on POSIX and on NFS/Lustre for a same-directory rename); a directory
is complete only once its `STABLE` marker exists, and the marker is written last. Readers
never read a directory without its marker, so a writer killed with SIGKILL leaves at most
an orphan temp file (named `.tmp.*`, ignored by readers) and never a partial file.

Waiting works under NFS attribute caching: instead of trusting a cached `stat`, the waiter
lists the parent directory (readdir revalidates the directory) and opens the file
(close-to-open consistency), polling with a short back-off so latency stays sub-second.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from prime_hpc.core import umask

STABLE = "STABLE"
TMP_PREFIX = ".tmp."


class WaitTimeout(TimeoutError):
    """A waited-for artifact did not appear in time. The message names the artifact,
    the producer and the tail of the producer's log."""


# ----------------------------------------------------------------------------- atomic I/O
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


with_umask = umask.applied  # the run's `cluster.umask` for a block (`prime_hpc.core.umask.applied`)


def atomic_write_bytes(path: os.PathLike | str, data: bytes, durable: bool = True, mode: Optional[int] = None) -> Path:
    """Write `data` to `path` so that a reader sees either nothing, the old content, or
    all of the new content: temp file in the same directory, fsync, `os.replace`.
    `durable=False` skips the fsyncs (file and directory): for records that are rewritten
    all the time and only advise (heartbeats, endpoints), where a crash of the node may
    lose the latest version but never tears one. `mode`: the file's permissions (default:
    what open() would give under the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, umask.file_mode() if mode is None else mode)  # mkstemp gives 0o600: hidden from teammates
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        _fsync_dir(path.parent)
    return path


def atomic_write_text(path: os.PathLike | str, text: str, durable: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode(), durable)


def atomic_write_json(path: os.PathLike | str, obj: Any, durable: bool = True) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", durable)


def read_json(path: os.PathLike | str) -> Any:
    with open(path) as f:
        return json.load(f)


def mark_stable(directory: os.PathLike | str, info: Optional[dict] = None) -> Path:
    """Declare `directory` complete. Call only after every file in it was written."""
    directory = Path(directory)
    _fsync_dir(directory)
    return atomic_write_json(directory / STABLE, {"time": time.time(), **(info or {})})


def stable_time(directory: os.PathLike | str) -> float:
    """When `directory` was marked complete (its marker's time; now if it has none)."""
    try:
        return float(read_json(Path(directory) / STABLE).get("time", time.time()))
    except (OSError, ValueError, TypeError, AttributeError):
        return time.time()


def is_stable(directory: os.PathLike | str) -> bool:
    directory = Path(directory)
    return exists_fresh(directory / STABLE)


def exists_fresh(path: Path) -> bool:
    """Existence check that does not trust a cached negative lookup on NFS: list the
    parent directory (forces a readdir round-trip) rather than stat the name."""
    try:
        # list the grandparent too: a cached "no such entry" for a step directory that
        # appeared later (rollouts/step_7) is dropped when its parent is re-read
        os.listdir(path.parent.parent)
    except OSError:
        pass
    try:
        return path.name in os.listdir(path.parent)
    except (FileNotFoundError, NotADirectoryError):
        return False


def tail(path: os.PathLike | str, lines: int = 20) -> str:
    """Last `lines` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def wait_for(
    ready: Callable[[], Any],
    *,
    what: str,
    timeout_s: float,
    producer: str = "",
    producer_log: Optional[os.PathLike | str] = None,
    alive: Optional[Callable[[], bool]] = None,
    poll_min_s: float = 0.01,
    poll_max_s: float = 0.25,
) -> Any:
    """Poll `ready()` until it returns something truthy and return that.

    Gives up after `timeout_s`, or at once when `alive()` says the producer is gone, with
    a `WaitTimeout` naming what was awaited, who should have produced it and the tail of
    its log. The poll interval backs off from `poll_min_s` to `poll_max_s`, so an artifact
    is picked up well under a second after it appears."""
    deadline = time.monotonic() + timeout_s
    delay = poll_min_s
    while True:
        value = ready()
        if value:
            return value
        producer_dead = alive is not None and not alive()
        if producer_dead or time.monotonic() >= deadline:
            reason = "its producer exited" if producer_dead else f"nothing after {timeout_s:g}s"
            msg = f"waited for {what}: {reason}"
            if producer:
                msg += f"; producer: {producer}"
            if producer_log is not None:
                msg += f"; see {producer_log}"
                log_tail = tail(producer_log, 10)
                if log_tail:
                    msg += "\n--- last lines of " + str(producer_log) + " ---\n" + log_tail
            raise WaitTimeout(msg)
        time.sleep(delay)
        delay = min(poll_max_s, delay * 1.5)


def truncate_jsonl(path: os.PathLike | str, keep: Callable[[dict], bool]) -> bool:
    """Rewrite a JSON-lines file (atomically) with only the rows `keep` accepts; torn or
    foreign lines go too. True if anything was dropped."""
    path = Path(path)
    kept, dropped = [], False
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and keep(row)
        except (ValueError, TypeError):
            ok = False
        if ok:
            kept.append(line)
        else:
            dropped = True
    if dropped:
        atomic_write_text(path, "".join(f"{ln}\n" for ln in kept))
    return dropped


def staging_dir(final: os.PathLike | str) -> Path:
    """A fresh temp directory next to `final` (same filesystem) to build it in, named so
    readers ignore it; hand it to `publish_dir` when everything is written."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}.", dir=final.parent))


def publish_dir(staging: os.PathLike | str, final: os.PathLike | str, info: Optional[dict] = None) -> Path:
    """Move a fully written `staging` directory to `final` (replacing an older copy, e.g.
    after a resume) and write its `STABLE` marker last."""
    staging, final = Path(staging), Path(final)
    os.chmod(staging, umask.dir_mode())  # mkdtemp makes 0700; some writers make 0600 files
    for p in staging.rglob("*"):
        os.chmod(p, umask.dir_mode() if p.is_dir() else umask.file_mode())
        if p.is_dir():
            _fsync_dir(p)
    _fsync_dir(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    mark_stable(final, info)
    return final


def wait_stable(directory: os.PathLike | str, **kwargs: Any) -> Path:
    """Wait until `directory/STABLE` exists; see `wait_for`."""
    directory = Path(directory)
    kwargs.setdefault("what", f"{directory}/{STABLE}")
    return wait_for(lambda: directory if is_stable(directory) else None, **kwargs)


def wait_file(path: os.PathLike | str, **kwargs: Any) -> Path:
    """Wait until the (atomically written) file `path` exists; see `wait_for`."""
    path = Path(path)
    kwargs.setdefault("what", str(path))
    return wait_for(lambda: path if exists_fresh(path) else None, **kwargs)


# ----------------------------------------------------------------------------- layout
