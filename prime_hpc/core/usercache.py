"""Where prime-hpc keeps what it later loads as code (compiled job templates, composed
configs as pickles, vLLM's and inductor's compile caches), and the one check that decides
whether such a place is trusted: **owned by this user and writable by nobody else**.

- `path(name)` / `directory(name)`: the user's own cache, `$XDG_CACHE_HOME/prime-hpc/<name>`
  (default `~/.cache/...`), for derived files that are safe to lose;
- `compile_dir(shared)`: the user's private directory in a run's shared cache
  (`cluster.cache_dir`, which other users may write if it is sticky, e.g. a project
  directory): `<shared>/compile-<uid>`, mode 0700. Built models stay in the shared part
  (they are data, loaded without running code); compiled code never does.
- `private_dir(p)`: any directory that must stay the user's alone for as long as it is
  used by path (the compile caches, inductor's headers in the node's temporary
  directory, what `eval` writes for a run of someone else's).

The check is made on an opened descriptor, never on a path that is looked up again: a
directory is opened with `O_NOFOLLOW | O_DIRECTORY` and `fstat`ed; a file is opened
relative to that descriptor (`dir_fd=`, `O_NOFOLLOW`), `fstat`ed and read from the same
descriptor. A symlink, someone else's directory or file, or one that group or others can
write is never loaded.

A directory handed to another program by path (vLLM and inductor look their caches up
again much later) is only as safe as the directories above it: whoever may write one of
them can rename the user's directory away and put their own in its place. So
`private_dir` walks the real path from `/` down, one descriptor at a time without
following a link, and trusts it only when every directory above is root's or the
user's and, where group or others may write it, sticky (`/tmp`: there nobody renames
an entry that is not theirs); it hands out that real path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Iterator, Optional

from prime_hpc.core.errors import ConfigError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# a directory above: only looked at and walked through (O_PATH needs no read permission)
_ABOVE = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO cannot hang a read
_WHY = {
    errno.ELOOP: "is a symbolic link",
    errno.ENOTDIR: "is not a directory",
    errno.ENOENT: "does not exist",
    errno.EACCES: "cannot be opened (permission denied)",
}
COMPILE_FIX = "compiled code is loaded only from a directory of your own that nobody else can write"


class Untrusted(Exception):
    """A directory or file that is not this user's alone; the message names it and why."""

    def __init__(self, path: os.PathLike | str, why: str) -> None:
        self.path, self.why = Path(path), why
        super().__init__(f"{path} {why}")


def owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def problem(st: os.stat_result, directory: bool) -> Optional[str]:
    """Why what `st` describes is not to be trusted (None when it is the user's own
    directory, or regular file, that nobody else can write)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"belongs to {owner_name(st.st_uid)}, not to you"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by group or others"
    return None


def problem_above(st: os.stat_result) -> Optional[str]:
    """Why a directory above a private one lets someone else replace what is below it
    (None when only root or the user can rename its entries)."""
    if st.st_uid not in (0, os.getuid()):
        return f"belongs to {owner_name(st.st_uid)}, who can rename what is in it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return "is writable by group or others without the sticky bit (chmod +t): they can rename what is in it"
    return None


def _open_below(fd: int, name: str, where: Path, flags: int) -> int:
    """`name` in the directory `fd`, never through a link: `Untrusted` for a link, the
    `OSError` (not a directory, permission denied) otherwise."""
    try:
        return os.open(name, flags, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(where):
            raise Untrusted(where, _WHY[errno.ELOOP]) from None
        raise OSError(e.errno, f"{where}: {e.strerror}") from None


def private_tree(p: os.PathLike | str) -> Path:
    """`private_dir(p)`, every missing directory on the way to it made 0700 too (not only
    `p`): `private/envservers/pylib` of an eval's or synthesize's own directory is private
    like a run's, whose `private/` submit made 0700."""
    p = Path(p).expanduser().absolute()
    for missing in reversed([d for d in (p, *p.parents) if not d.exists()]):
        private_dir(missing)
    return private_dir(p)


def private_dir(p: os.PathLike | str, create: bool = True) -> Path:
    """`p`'s real path, once `p` is a directory only this user can change, now and later:
    the user's, not a symlink, writable by nobody else, and below directories that are
    root's or the user's and sticky where others may write them (`problem_above`).
    `create`: missing directories are made (`p` itself 0700, those above it under the
    umask); without it a missing `p` is fine if the user could make it. Raises `Untrusted`
    naming the first directory that fails and why, or `OSError` where one cannot be made
    or opened (a file on the way, no permission)."""
    p = Path(p).expanduser().absolute()
    if p.parent == p:
        raise Untrusted(p, "is the root directory")
    real = Path(os.path.realpath(p.parent)) / p.name
    fd = os.open("/", _ABOVE)
    here = Path("/")
    try:
        for i, name in enumerate(real.parts[1:]):
            bad = problem_above(os.fstat(fd))
            if bad:
                raise Untrusted(here, bad)
            here, last = here / name, i == len(real.parts) - 2
            if create and not os.path.lexists(here):
                with contextlib.suppress(FileExistsError):  # whatever is there is checked below
                    os.mkdir(name, 0o700 if last else 0o777, dir_fd=fd)
            elif not os.path.lexists(here):
                if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
                    raise PermissionError(errno.EACCES, f"{here.parent} is not writable")
                return real
            below = _open_below(fd, name, here, _DIR if last else _ABOVE)
            os.close(fd)
            fd = below
        bad = problem(os.fstat(fd), directory=True)
        if bad:
            raise Untrusted(real, bad)
        return real
    finally:
        os.close(fd)


@contextlib.contextmanager
def opened_dir(p: os.PathLike | str) -> Iterator[int]:
    """A descriptor of the directory `p`, opened without following a symlink and checked
    on that descriptor; raises `Untrusted` (naming `p` and why) otherwise."""
    try:
        fd = os.open(p, _DIR)
    except OSError as e:  # refused; lstat only says why (O_DIRECTORY may win over O_NOFOLLOW)
        link = e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(p)
        why = _WHY[errno.ELOOP] if link else _WHY.get(e.errno or 0, f"cannot be opened ({e.strerror})")
        raise Untrusted(p, why) from None
    try:
        bad = problem(os.fstat(fd), directory=True)
        if bad:
            raise Untrusted(p, bad)
        yield fd
    finally:
        os.close(fd)


def trusted(p: os.PathLike | str) -> bool:
    """`p` is a directory of this user's that nobody else can write (False if absent)."""
    try:
        with opened_dir(p):
            return True
    except Untrusted:
        return False


def _plain(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r}: a file name, not a path")
    return name


def read(directory: os.PathLike | str, name: str) -> Optional[bytes]:
    """The content of `directory/name` when the directory and the file are both trusted;
    None when either is not, or the file is absent or unreadable."""
    try:
        with opened_dir(directory) as dfd:
            fd = os.open(_plain(name), _FILE, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                if problem(os.fstat(fd), directory=False):
                    return None
                return f.read()
    except (OSError, Untrusted):
        return None


def read_own(p: os.PathLike | str) -> bytes:
    """The content of the regular file `p` when it is the user's and writable by nobody
    else, checked on the descriptor it is read from (never through a link). Raises
    `Untrusted` naming it and why, `OSError` when it cannot be read."""
    try:
        fd = os.open(p, _FILE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(p, _WHY[errno.ELOOP]) from None
        raise
    with os.fdopen(fd, "rb") as f:
        bad = problem(os.fstat(fd), directory=False)
        if bad:
            raise Untrusted(p, bad)
        return f.read()


def write(directory: os.PathLike | str, name: str, data: bytes) -> None:
    """Write `directory/name` (mode 0600) atomically, relative to the trusted directory's
    descriptor: a temporary name created exclusively, then renamed over `name`. Raises
    `OSError` or `Untrusted`; never leaves the temporary file behind."""
    with opened_dir(directory) as dfd:
        tmp = f".tmp.{_plain(name)}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise


def path(name: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prime-hpc" / name


def directory(name: str) -> Optional[Path]:
    """`path(name)`, created 0700 if missing; None when it cannot be made or is not trusted."""
    p = path(name)
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return p if trusted(p) else None


def compile_dir(shared: os.PathLike | str, create: bool = True) -> Path:
    """The user's private directory for compile caches in the shared cache `shared`:
    `<shared>/compile-<uid>` (its real path), created 0700 (`create`) and checked, with
    every directory above it, by `private_dir`. Without `create` (at submit time, when
    nothing may be written) a missing one is fine if it can be made. Raises a one-line
    `ConfigError` on `cluster.cache_dir` naming the path and the fix."""
    p = Path(shared) / f"compile-{os.getuid()}"
    fix = "set cluster.cache_dir to a directory of your own"
    try:
        return private_dir(p, create)
    except OSError as e:
        raise ConfigError("cluster.cache_dir", f"cannot create {p} ({e.strerror}); {fix}") from None
    except Untrusted as e:
        if e.path.name == p.name:
            raise ConfigError("cluster.cache_dir", f"{e}; {COMPILE_FIX}: remove it, or {fix}") from None
        raise ConfigError("cluster.cache_dir", f"{e} (above {p}); {fix}") from None  # a directory above it
