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
from typing import Any, Callable, Optional, Sequence

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


# ----------------------------------------------------------------------------- reading the ends of files
def read_tail(path: os.PathLike | str, max_bytes: int) -> tuple[int, bytes]:
    """(offset, data): the last `max_bytes` bytes of the file `path` (all of a smaller
    one) and the offset they start at; (0, b"") when it cannot be read. Every reader of a
    file's end (logs, metrics) goes through here or `tail_lines`."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(0, f.tell() - max_bytes)
            f.seek(start)
            return start, f.read()
    except OSError:
        return 0, b""


def tail_lines(path: os.PathLike | str, max_bytes: int, *, keep_cut: bool = False) -> list[str]:
    """The lines in the last `max_bytes` bytes of the file `path`, decoded (undecodable
    bytes replaced), the last one possibly unterminated; [] when it cannot be read. When
    the window starts inside the file its first line is cut: it is left out, unless
    `keep_cut` (text for a reader, where part of a line says more than none)."""
    start, data = read_tail(path, max_bytes)
    lines = data.decode(errors="replace").splitlines()
    return lines[1:] if start and not keep_cut else lines


def last_line(path: Path, max_bytes: int = 8192, cut: Optional[int] = 300) -> str:
    """The last non-blank line of the log `path` (at most `cut` characters, None: whole;
    '' if none)."""
    lines = [ln.strip() for ln in tail_lines(path, max_bytes, keep_cut=True) if ln.strip()]
    return lines[-1][:cut] if lines else ""


def tail(path: os.PathLike | str, lines: int = 20) -> str:
    """Last `lines` lines of a text file, from its last 64 KiB ('' if it does not exist)."""
    return "\n".join(tail_lines(path, 64 * 1024, keep_cut=True)[-lines:])


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


# ----------------------------------------------------------------------------- JSON lines with a step
def jsonl_row(line: str | bytes, *, with_step: bool = True) -> Optional[dict]:
    """The row on one line of a JSON-lines file (metrics: `{"step": int, ...}`), or None
    for a torn, non-JSON or non-object line and, `with_step`, for one without an integer
    `step` (a bool is no step). Every reader of those files parses lines here."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    if with_step and (not isinstance(row.get("step"), int) or isinstance(row["step"], bool)):
        return None
    return row


def read_rows(path: os.PathLike | str, max_bytes: Optional[int] = None) -> list[dict]:
    """The rows with an integer `step` of a JSON-lines file, in file order (`jsonl_row`):
    of all of it, or, with `max_bytes`, of its last `max_bytes` bytes (a first line the
    window cuts is left out). A missing file has none."""
    if max_bytes is None:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except (FileNotFoundError, NotADirectoryError):
            return []
    else:
        lines = tail_lines(path, max_bytes)
    return [row for row in map(jsonl_row, lines) if row is not None]


def truncate_jsonl(path: os.PathLike | str, keep: Callable[[dict], bool]) -> bool:
    """Rewrite a JSON-lines file (atomically) with only the rows `keep` accepts; torn or
    foreign lines go too. True if anything was dropped."""
    path = Path(path)
    kept, dropped = [], False
    for line in path.read_text().splitlines():
        row = jsonl_row(line, with_step=False)
        try:
            ok = row is not None and keep(row)
        except (ValueError, TypeError):
            ok = False
        if ok:
            kept.append(line)
        else:
            dropped = True
    if dropped:
        atomic_write_text(path, "".join(f"{ln}\n" for ln in kept))
    return dropped


# ----------------------------------------------------------------------------- deleting
class MarkerError(RuntimeError):
    """A marker could not be removed, so nothing else of its directory was deleted (a
    directory may go only once no reader can take it for complete)."""


def remove_marked(
    path: os.PathLike | str, markers: Sequence[str] = (STABLE,), *, keep_root: bool = False, check: bool = False
) -> None:
    """Delete the directory `path` so that no moment of the deletion looks complete: first
    every marker in it (entries named as in `markers`, at any depth: a checkpoint step holds
    one per part), then the rest; `keep_root` empties `path` and leaves it. Every deletion
    of a marked directory of the run (rollouts, weights, checkpoints, the run directory
    itself, a preflight's directory) goes through here.

    A marker that cannot be removed (or a directory that cannot be searched for markers)
    stops it before anything but the other markers is deleted, with `MarkerError` (one line
    naming it and why). Once the markers are gone, what cannot be deleted is left, unmarked: readers
    ignore it and the next deletion takes it; `check` raises the first such `OSError`
    after deleting all it could. A missing `path` is no error; a symbolic link (unless
    `keep_root`) is not followed: nothing is deleted (`check`: an `OSError`)."""
    path = Path(path)
    if not path.is_dir():
        return
    if path.is_symlink() and not keep_root:
        if check:
            raise OSError(f"{path}: a symbolic link, not a directory to delete")
        return
    stuck = []
    for marker in _markers_in(path, markers):
        try:
            os.unlink(marker)
        except FileNotFoundError:
            continue
        except OSError as e:
            stuck.append((marker, e))
            continue
        _fsync_dir(marker.parent)  # the marker is gone on disk before anything it vouches for
    if stuck:
        marker, err = stuck[0]
        raise MarkerError(
            f"{marker}: the marker cannot be removed ({err.strerror or err}); nothing of {path} but its other "
            "markers was deleted"
        )
    errors: list[OSError] = []

    def collect(_fn: Any, _path: Any, exc_info: Any) -> None:
        errors.append(exc_info[1])

    if keep_root:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, onerror=collect)
            else:
                try:
                    os.unlink(entry.path)
                except OSError as e:
                    errors.append(e)
    else:
        shutil.rmtree(path, onerror=collect)
    if check and errors:
        raise errors[0]


def _markers_in(path: Path, markers: Sequence[str]) -> list[Path]:
    """Every entry named as in `markers` under `path` (symlinks not followed)."""

    def unsearchable(e: OSError) -> None:
        if not isinstance(e, FileNotFoundError):  # gone meanwhile: nothing to find there
            raise MarkerError(f"{e.filename}: cannot be searched for markers ({e.strerror or e}); nothing was deleted")

    found = []
    for top, dirs, files in os.walk(path, onerror=unsearchable):
        found += [Path(top, name) for name in (*files, *dirs) if name in markers]
    return found


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
    remove_marked(final, check=True)
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
