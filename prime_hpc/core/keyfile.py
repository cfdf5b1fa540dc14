"""The job's key kept where only its owner can read it: `<output_dir>/private/api_key`, a
0600 file in a 0700 directory of the run, so that the user's later commands (`scale`,
`eval serve=`, `synthesize serve=`, `resume`) can give the job's servers the key they
demand, also when the run was submitted without an exported `INFERENCE_SERVER_API_KEY`
(a key made at random for the job). The job itself gets the key only from its
environment; nothing else of the run holds it.

Both ways go through opened descriptors with `prime_hpc.core.usercache`'s checks (no
symlink followed; the user's own; writable by nobody else) and, the content being a
secret, readable by nobody else either: the directory is opened with `O_NOFOLLOW`, the
file relative to it (`dir_fd=`), each `fstat`ed, and the file read from the descriptor it
was checked on; it is written to a temporary name created exclusively (0600) and renamed
over the old one within that directory. A directory or file that is someone else's, a
symlink, or open to group or others is refused in one line (`KeyFileError`) naming it and
the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Iterator, Optional

from prime_hpc.core.errors import UserError
from prime_hpc.core.usercache import Untrusted, opened_dir, problem

NAME = "api_key"  # the file, in the run's private directory (`RunDir.private_dir`)
MIN_BYTES = 32  # a key the user chooses is at least this long (one made here: 43 characters)
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
FIX = "the job's key is kept only in a directory (0700) and file (0600) of your own that nobody else can read"


class KeyFileError(UserError):
    """The run's key file cannot be trusted or written; one line naming it and why."""


def _private(st: os.stat_result, directory: bool) -> Optional[str]:
    """`usercache.problem`, and not readable (or searchable) by group or others."""
    bad = problem(st, directory)
    if bad is None and stat.S_IMODE(st.st_mode) & 0o077:
        bad = f"is open to group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return bad


@contextlib.contextmanager
def _opened(directory: Path) -> Iterator[int]:
    try:
        with opened_dir(directory) as fd:
            bad = _private(os.fstat(fd), directory=True)
            if bad:
                raise Untrusted(directory, bad)
            yield fd
    except Untrusted as e:
        raise KeyFileError(f"{e}; {FIX}") from None


def read(directory: os.PathLike | str) -> Optional[str]:
    """The key kept in `directory` (the run's private directory); None when there is no
    such directory or file (a run submitted before keys were kept); `KeyFileError` when
    either is not the user's alone, or the file is empty."""
    directory = Path(directory)
    if not os.path.lexists(directory):
        return None
    with _opened(directory) as dfd:
        try:
            fd = os.open(NAME, _FILE, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            why = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
            raise KeyFileError(f"{directory / NAME} {why}; {FIX}") from None
        with os.fdopen(fd, "rb") as f:
            bad = _private(os.fstat(fd), directory=False)
            if bad:
                raise KeyFileError(f"{directory / NAME} {bad}; {FIX}")
            key = f.read().decode("utf-8", "replace").strip()
    if not key:
        raise KeyFileError(f"{directory / NAME} is empty; submit the run again or export the key it was submitted with")
    return key


def write(directory: os.PathLike | str, key: str) -> Path:
    """Keep `key` in `directory/api_key` (0600; the directory made 0700 if missing, else
    checked); the file's path. `KeyFileError` when the directory is not the user's alone
    or cannot be made."""
    directory = Path(directory)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass  # checked on its descriptor below
    except OSError as e:
        raise KeyFileError(f"cannot create {directory} ({e.strerror}); {FIX}") from None
    with _opened(directory) as dfd:
        tmp = f".tmp.{NAME}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key.encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    return directory / NAME


def too_short(key: str) -> bool:
    """A key the user chose that is shorter than `MIN_BYTES` bytes."""
    return len(key.encode()) < MIN_BYTES
