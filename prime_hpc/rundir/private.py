"""The run's private directory (`RunDir.rendezvous_dir`, mode 0700): where its processes
meet in file stores (torchrun's rendezvous, the trainer's process group, a weight group on
one host) instead of TCP stores that anyone who reaches their port can join.

`ensure(d)` makes `d` (0700) in the run's directory, or checks the one there, on opened
descriptors, never through a link: the run's directory must be the user's and writable by
nobody else (what `submit` made it); `d` must be the user's directory (one of the user's
with wider permissions is narrowed to 0700 on its descriptor), and nothing in it may be
someone else's. Otherwise `Untrusted`, naming what and why. With `empty`, what is in it is
removed (each attempt meets in fresh stores). The directories above the run's are the
run's own concern: whoever can replace those can replace the whole run.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from prime_hpc.core.usercache import Untrusted, opened_dir, owner_name, problem

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

__all__ = ["Untrusted", "ensure"]


def ensure(d: os.PathLike | str, empty: bool = False) -> Path:
    """`d` (a directory directly in the run's directory), private to this user: made 0700
    if missing, checked otherwise; raises `Untrusted` naming the directory or the entry in
    it that is not the user's alone, `OSError` where it cannot be made."""
    d = Path(os.path.realpath(Path(d).parent)) / Path(d).name
    with opened_dir(d.parent) as root:
        try:
            os.mkdir(d.name, 0o700, dir_fd=root)
        except FileExistsError:
            pass  # checked below, on its descriptor
        try:
            fd = os.open(d.name, _DIR, dir_fd=root)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Untrusted(d, "is a symbolic link" if os.path.islink(d) else "is not a directory") from None
            raise
    try:
        st = os.fstat(fd)
        bad = problem(st, directory=True)
        if bad:
            raise Untrusted(d, bad)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        for name in os.listdir(fd):
            entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if entry.st_uid != os.getuid():
                raise Untrusted(d / name, f"belongs to {owner_name(entry.st_uid)}, not to you")
            if empty and not stat.S_ISDIR(entry.st_mode):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    return d
