"""Job records: `job.json` in each run directory (the truth about a run: job ids incl.
requeues and resumes, overrides, git sha, cluster, state, attempts, failure) and a small
index of submitted runs in the user's state dir, so a job can be named by SLURM id, run
name or output dir. Light imports only: this backs `status` and `list`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from prime_hpc.core.errors import JobNotFound, UserError
from prime_hpc.rundir import COMPONENTS, RunDir, atomic_write_json, read_json

# job.json "state" values (SLURM's vocabulary where it has one)
PENDING, RUNNING, COMPLETED, FAILED, CANCELLED = "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"
REQUEUED = "REQUEUED"  # an attempt ended (time limit, preemption, requeue); the next one is queued
FINAL_STATES = {
    COMPLETED,
    FAILED,
    CANCELLED,
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def state_dir() -> Path:
    """Where prime-hpc keeps per-user state (`$PRIME_HPC_STATE_DIR`, else XDG state)."""
    env = os.environ.get("PRIME_HPC_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "prime-hpc"


def index_file() -> Path:
    return state_dir() / "jobs.jsonl"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock next to `path` (flock; POSIX lockf where flock is not supported,
    e.g. Lustre mounted without -o flock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            unlock = lambda: fcntl.flock(lock, fcntl.LOCK_UN)  # noqa: E731
        except OSError:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            unlock = lambda: fcntl.lockf(lock, fcntl.LOCK_UN)  # noqa: E731
        try:
            yield
        finally:
            unlock()


# ----------------------------------------------------------------------------- job.json
def on_node(record: dict) -> str:
    """The " on node N (host)" part of a failure or loss record that names its node (none
    for an inference server, whose name already says which: `inference_1`)."""
    if record.get("node") is None or str(record.get("component") or "").startswith("inference_"):
        return ""
    return f" on node {record['node']}" + (f" ({record['host']})" if record.get("host") else "")


class BadJobFile(UserError):
    """A job.json that is no job record: cut short, not a JSON object, or a field of another
    type than prime-hpc writes (`JOB_FIELDS`), or a file that cannot be read."""


# The types of the fields that readers use (None is allowed for each: a field not set)
JOB_FIELDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("name", "state", "backend", "kind", "mode", "output_dir", "git_sha", "pid_start"), (str,)),
    **dict.fromkeys(("job_ids", "attempts", "extra_jobs", "groups", "overrides", "runs"), (list,)),
    **dict.fromkeys(("pipeline", "sweep", "failure", "cluster"), (dict,)),
    **dict.fromkeys(("submitted_at", "updated_at", "ended_at", "cancelled_at"), (int, float)),
    **dict.fromkeys(("pid", "attempt", "requeues", "fleet_nodes"), (int,)),
}


def job_shape_error(job: Any) -> Optional[str]:
    """What makes `job` (parsed JSON) no job record, or None: it is an object, every field of
    `JOB_FIELDS` it has is of its type or null, every attempt and extra job is an object, and
    every extra job has its id."""
    if not isinstance(job, dict):
        return f"it holds {type(job).__name__}, not an object"
    for key, types in JOB_FIELDS.items():
        value = job.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            return f"its {key!r} is {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}"
    for key in ("attempts", "extra_jobs"):
        if not all(isinstance(x, dict) for x in job.get(key) or []):
            return f"an entry of its {key!r} is not an object"
    if not all("job_id" in x for x in job.get("extra_jobs") or []):
        return "an entry of its 'extra_jobs' has no 'job_id'"
    return None


def parse_job(data: bytes, path: Path) -> dict[str, Any]:
    """job.json's content `data` (of the file `path`) as a job record; `BadJobFile` naming
    the file when it is none (`job_shape_error`)."""
    try:
        job = json.loads(data.decode())
    except ValueError as e:  # cut short, not JSON, not UTF-8
        raise BadJobFile(
            f"{path}: cannot be read as a job record ({type(e).__name__}: {e}); restore it or remove the run"
        ) from None
    problem = job_shape_error(job)
    if problem:
        raise BadJobFile(f"{path}: not a job record prime-hpc wrote ({problem}); restore it or remove the run")
    return job


def read_job(run: RunDir) -> dict[str, Any]:
    """The run's job.json ({} when it has none): the one reader of it (`own_job` reads it
    the same way, after its checks). A file that is no job record, or that cannot be read,
    raises `BadJobFile` naming it."""
    try:
        data = run.job_json.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise BadJobFile(f"{run.job_json}: cannot be read ({e.strerror})") from None
    return parse_job(data, run.job_json)


class NotYours(UserError):
    """A command that acts on a job (signals it, cancels it, submits from its config)
    given a run that is not the user's alone."""


_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO cannot hang the read


def own_job(run: RunDir, doing: str) -> dict[str, Any]:
    """The run's job.json, for `doing` something to its job (`cancel`: a signal to the pid
    it names, scancel of its job ids; `resume`, `scale`: a job submitted from its config):
    read only when the run's directory is the user's and writable by nobody else, and
    job.json the user's regular file (not a link) that nobody else can write: checked on
    the opened descriptors and read from them (`core.usercache`). Otherwise `NotYours`,
    one line naming the path and why."""
    from prime_hpc.core import usercache

    try:
        data = read_owned(run, run.job_json)
    except usercache.Untrusted as e:
        raise NotYours(f"cannot {doing} the job of {run.root}: {e}; {doing} acts only on runs of your own") from None
    return parse_job(data, run.job_json)


def read_owned(run: RunDir, path: Path, missing_ok: bool = False) -> bytes:
    """The bytes of `path`, a file directly in the run's directory, read only when that
    directory is the user's and writable by nobody else and the file the user's regular
    file (not a link) that nobody else can write: checked on the opened descriptors and
    read from them. Otherwise `core.usercache.Untrusted` naming the path and why (a missing
    file too, unless `missing_ok`: then FileNotFoundError)."""
    from prime_hpc.core import usercache

    with usercache.opened_dir(os.path.realpath(run.root)) as dfd:
        try:
            fd = os.open(path.name, _FILE, dir_fd=dfd)
        except FileNotFoundError:
            if missing_ok:
                raise
            raise usercache.Untrusted(path, f"cannot be opened ({os.strerror(errno.ENOENT)})") from None
        except OSError as e:
            why = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
            raise usercache.Untrusted(path, why) from None
        with os.fdopen(fd, "rb") as f:
            bad = usercache.problem(os.fstat(fd), directory=False)
            if bad:
                raise usercache.Untrusted(path, bad)
            return f.read()


def readable_job(run: RunDir) -> dict[str, Any]:
    """`read_job`, with {} for a job.json that is no job record (a scan over many runs, which
    one bad file must not stop)."""
    try:
        return read_job(run)
    except BadJobFile:
        return {}


@contextlib.contextmanager
def editing_job(run: RunDir) -> Iterator[dict[str, Any]]:
    """Read-modify-write job.json under its lock: mutate the yielded dict."""
    with _locked(run.job_json):
        job = read_job(run)
        yield job
        job["updated_at"] = time.time()
        atomic_write_json(run.job_json, job)


def update_job(run: RunDir, **changes: Any) -> dict[str, Any]:
    """Set `changes` in job.json (read-modify-write under its lock)."""
    with editing_job(run) as job:
        job.update(changes)
    return job


def git_sha(path: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def job_groups(job: dict[str, Any]) -> list[str]:
    """The groups a recorded job runs (in het-group order)."""
    return list(job.get("groups") or COMPONENTS)


# ----------------------------------------------------------------------------- extra inference jobs
# `prime-hpc scale` adds jobs of inference servers to a running run; job.json records each
# under `extra_jobs` (oldest first): {job_id, nodes, backend, submitted_at, state, started_at,
# ended_at, end, logs, batch_log, script, overrides, lost}. The launcher writes a record when
# it submits the job (PENDING) and CANCELLED before it cancels one; the job itself RUNNING
# when it starts and its end (`prime_hpc.job.extra`).
def extra_jobs(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's extra inference jobs, as job.json records them (oldest first)."""
    return [dict(x) for x in job.get("extra_jobs") or []]


def extra_job(job: dict[str, Any], job_id: str) -> Optional[dict[str, Any]]:
    """The record of extra job `job_id` (None: not an extra job of this run)."""
    return next((x for x in extra_jobs(job) if str(x.get("job_id")) == str(job_id)), None)


def add_extra_job(run: RunDir, record: dict[str, Any]) -> None:
    with editing_job(run) as job:
        job.setdefault("extra_jobs", []).append(record)


def update_extra_job(run: RunDir, job_id: str, **changes: Any) -> Optional[dict[str, Any]]:
    """Set `changes` in the record of extra job `job_id` (under job.json's lock); the
    record as written, None when the run has no such extra job."""
    with editing_job(run) as job:
        for x in job.get("extra_jobs") or []:
            if str(x.get("job_id")) == str(job_id):
                x.update(changes)
                return dict(x)
    return None


# ----------------------------------------------------------------------------- index
@dataclass
class JobRef:
    job_id: str  # as its backend names it (SLURM: the het leader's id)
    name: str
    output_dir: str
    backend: str  # which backend runs it (`prime_hpc.sched.choose`)
    submitted_at: float
    mode: str = "run"  # run | doctor
    kind: str = "rl"  # rl | sft | eval | serve | synthesize
    sweep: Optional[str] = None  # the sweep id (`submit -m`) of a sweep point

    @property
    def run(self) -> RunDir:
        return RunDir(self.output_dir)


def record(ref: JobRef) -> None:
    """Append `ref` to the user's job index."""
    with _locked(index_file()):
        with open(index_file(), "a") as f:
            f.write(json.dumps(ref.__dict__) + "\n")


def recent(limit: Optional[int] = None) -> list[JobRef]:
    """Indexed jobs, newest first."""
    try:
        lines = index_file().read_text().splitlines()
    except FileNotFoundError:
        return []
    refs = []
    for line in lines:
        try:
            refs.append(JobRef(**json.loads(line)))
        except (ValueError, TypeError):
            continue  # a torn or foreign line never breaks `list`
    refs.reverse()
    return refs[:limit] if limit else refs


def resolve_many(name: str) -> list[JobRef]:
    """A sweep id names every point of the sweep (in order); anything else one job."""
    points = [r for r in recent() if r.sweep == name]
    if points:
        by_dir = {r.output_dir: r for r in points}  # newest record of each point
        return sorted(by_dir.values(), key=lambda r: (read_job(r.run).get("sweep") or {}).get("point", 0))
    return [resolve(name)]


def resolve(name: str) -> JobRef:
    """A job named by SLURM id, run name or output dir (newest match wins)."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "job.json").exists():
        job = read_job(RunDir(path))
        ids = job.get("job_ids") or ["?"]
        return JobRef(
            job_id=str(ids[-1]),
            name=job.get("name", path.name),
            output_dir=str(RunDir(path).root),
            backend=job.get("backend", "?"),
            submitted_at=job.get("submitted_at", 0),
            mode=job.get("mode", "run"),
            kind=job.get("kind", "rl"),
            sweep=(job.get("sweep") or {}).get("id"),
        )
    refs = recent()
    for ref in refs:
        if ref.job_id == name or ref.job_id.split("_")[0] == name:
            return ref
    for ref in refs:
        if ref.name == name:
            return ref
    for ref in refs:  # a job id of an earlier attempt (resume/requeue) recorded in job.json
        if name in [str(i) for i in readable_job(ref.run).get("job_ids") or []]:
            return ref
    hint = f"; known: {', '.join(r.job_id + ' (' + r.name + ')' for r in refs[:5])}" if refs else ""
    raise JobNotFound(f"no job {name!r} (give a SLURM job id, a run name or an output dir){hint}")


# ----------------------------------------------------------------------------- processes
def start_time(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (tells a reused pid from ours); None if gone or a
    zombie (exited, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def served(run: RunDir) -> Optional[dict]:
    """What a serve job publishes while it serves (`serve.json`), or None: also when the
    job has ended (a head killed without its cleanup leaves the file behind)."""
    try:
        found = read_json(run.serve_json)
    except (OSError, ValueError):
        return None
    if read_job(run).get("state") in FINAL_STATES:
        return None
    return found if isinstance(found, dict) and found.get("url") else None


def serve_job(name: str) -> RunDir:
    """The run directory of serve job `name` (its directory, a job id or a run name)."""
    path = Path(name).expanduser()
    return RunDir(path) if (path / "job.json").exists() else resolve(name).run
