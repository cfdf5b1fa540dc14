"""Run a Python module and kill it with SIGKILL at an exact moment of its own file work: the
instant it is about to create, rename or delete a given file, in whichever thread does it.

    python -m tests.killpoint EVENT REGEX N -m MODULE [ARGS...]
    python -m tests.killpoint EVENT REGEX N -c CODE [ARGS...]

EVENT is `write` (a file opened for writing or created), `rename` (`os.rename`/`os.replace`,
matched on the destination) or `remove` (`os.unlink`/`os.remove`, also those `shutil.rmtree`
makes). At the Nth such operation whose absolute path matches REGEX (`re.search`), the
process prints one line to stderr (`killpoint: SIGKILL before <event> <path> in thread
<name>`; for a rename, `before rename <path> from <source> (<n> bytes) in thread <name>`:
the file about to be renamed into place, and its size at that instant, which shows the kill
landed inside an atomic write, its data written and not yet in place) and sends itself
SIGKILL: the kernel ends every thread at once, before that operation happens, as `kill -9`
from outside would at that instant. The hook is Python's audit hook (PEP 578): the program
itself is not changed, only watched.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import sys
import threading

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _path(path: object, dir_fd: object = None) -> str | None:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return None  # an open file descriptor
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
        try:
            return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return path
    return os.path.abspath(path)


def _target(event: str, args: tuple) -> tuple[str, str | None] | None:
    """(kind, path) of an audit event this tool can stop at."""
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
        return ("write", _path(path)) if writes else None
    if event == "os.rename":
        return "rename", _path(args[1], args[3])
    if event == "os.remove":
        return "remove", _path(args[0], args[1])
    return None


def _source(event: str, args: tuple) -> str:
    """For a rename: ` from <source> (<n> bytes)`, the file about to be renamed as it is now."""
    if event != "os.rename":
        return ""
    src = _path(args[0], args[2])
    try:
        return f" from {src} ({os.stat(src).st_size} bytes)" if src else ""
    except OSError as e:
        return f" from {src} ({e.strerror})"


def install(kind: str, pattern: str, nth: int) -> None:
    regex = re.compile(pattern)
    seen = [0]

    def hook(event: str, args: tuple) -> None:
        hit = _target(event, args)
        if hit is None or hit[0] != kind or hit[1] is None or not regex.search(hit[1]):
            return
        seen[0] += 1
        if seen[0] == nth:
            where = f"{kind} {hit[1]}{_source(event, args)} in thread {threading.current_thread().name}"
            os.write(2, f"killpoint: SIGKILL before {where}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def main() -> None:
    kind, pattern, nth, flag, what, *args = sys.argv[1:]
    if kind not in ("write", "rename", "remove") or flag not in ("-m", "-c"):
        raise SystemExit(__doc__)
    install(kind, pattern, int(nth))
    if flag == "-c":
        sys.argv = ["-c", *args]
        exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
        return
    sys.argv = [what, *args]
    runpy.run_module(what, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
