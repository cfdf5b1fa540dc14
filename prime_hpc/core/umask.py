"""The process's umask, read and applied safely with threads.

The umask belongs to the whole process, and the only portable way to read it, `os.umask`,
sets it too: a thread that creates a file between that call and the one restoring the
value gets the wrong permissions, and two threads doing it at once can leave the wrong
value behind. So:

- `current()` reads it without setting it where the kernel tells (Linux: the `Umask:`
  line of `/proc/self/status`); elsewhere it sets and restores it under `LOCK`;
- `others_write(value)`: why a umask that lets group or others write is refused (at submit,
  and by eval before its server starts);
- `applied(value)` sets it for a block (and for the processes started in it) and restores
  the previous one; each change is made under `LOCK`, so it never interleaves with the
  fallback read of `current()`.

Both are cheap (one small read of /proc); nothing else here touches the umask.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

LOCK = threading.RLock()  # held around every change of the umask made here
_STATUS = "/proc/self/status"


def proc_status(key: str) -> str | None:
    """The first word of field `key` of `/proc/self/status` ("Umask", "VmHWM"), None where
    the system does not give it."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split()[1]
    except (OSError, IndexError):
        pass
    return None


def _from_proc() -> int | None:
    """The umask from `/proc/self/status` (Linux >= 4.7), None where it is not given."""
    value = proc_status("Umask")
    try:
        return int(value, 8) if value is not None else None
    except ValueError:
        return None


def current() -> int:
    """This process's umask now (it may change: submit applies `cluster.umask`), read
    without changing it where the kernel tells, else set and restored under `LOCK`."""
    mask = _from_proc()
    if mask is not None:
        return mask
    with LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def parse(value: str | int) -> int:
    """A umask given as octal text ("027", `cluster.umask`) or as a number."""
    return value if isinstance(value, int) else int(str(value), 8)


@contextlib.contextmanager
def applied(value: str | int) -> Iterator[None]:
    """Everything created meanwhile by this process, and the processes and jobs it starts,
    gets the umask `value` (octal text such as "027", or a number); the previous umask is
    back afterwards, on every path."""
    with LOCK:
        previous = os.umask(parse(value))
    try:
        yield
    finally:
        with LOCK:
            os.umask(previous)


def file_mode() -> int:
    """0o666 minus the umask: what open() would give a new file."""
    return 0o666 & ~current()


def dir_mode() -> int:
    """0o777 minus the umask: what mkdir() would give a new directory."""
    return 0o777 & ~current()


def others_write(value: str | int) -> str | None:
    """Why the umask `value` is refused (None when it is not): one that leaves group or
    others write permission (000, 002, 020 ...) lets them change what the run writes, the
    configs its servers read included."""
    if parse(value) & 0o022 == 0o022:
        return None
    return (
        f"{value} lets group or others write what the run writes (the configs its processes load); "
        "use 027 (the default: nothing for others) or 022 (others may read)"
    )
