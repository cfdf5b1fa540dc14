"""`prime-hpc tail`: follow the logs of a job's latest attempt, every line prefixed with
its source, until the job ends.

Sources (one attempt's tree, `logs/latest -> attempt_<k>`; see docs/run-directory.md):

    orchestrator.log                    orchestrator
    runs/<name>/orchestrator.log        orchestrator[<name>]: run <name> of a job of several
    inference/node_<i>.log              inference[<i>]
    ../extra/<id>/inference/node_<id>.<n>.log   inference[<id>.<n>]: a server of an extra
                                        job (`prime-hpc scale`) that had not ended when the
                                        attempt started
    inference/router_<i>.log            router (router[<i>] for i > 0)
    teacher/node_<i>.log                teacher[<i>]: the run's own teacher's servers
    teacher/router_0.log                teacher-router
    trainer/node_<i>.log                trainer[<global rank>], and torchrun[<i>] for the
                                        lines of torchrun itself on node i
    envs/<kind>/<env>/env_server.log       env-server:<kind>/<env>: the env's server, when it
                                        runs in one (its workers' starts and restarts)
    envs/<kind>/<env>/env_worker_<w>.log   env:<kind>/<env> (env:<kind>/<env>[<w>] for w > 0)

Trainer ranks are read from `trainer/node_<i>.log`, where torchrun prefixes each line of
local rank l with `[default<l>]:`; the global rank is i * nproc_per_node + l. The per-rank
files under `trainer/torchrun/` are not used: their directories are named by local rank
under a per-node random name that does not say which node wrote them, each rank's stdout
and stderr are split in two files (a traceback loses its place among the lines before
it), and torchrun's own messages (a worker that died, a signal) are only in the node log.
The torchrun directories are still read once, to count the ranks per node.

What is printed is escaped for the terminal (`safe`): a log holds what a model generated,
an environment printed or, for a run of someone else's, anything its owner wrote; none of it
may drive the user's terminal (move the cursor, clear the screen, set the window's title or
the clipboard). Colour sequences are dropped, leaving their text; every other control
character but the tab (ESC, the rest of C0, DEL, C1) is shown as `\\xNN`. Other Unicode is
printed as it is.

By default the per-request noise is hidden (`is_noise`): the HTTP access lines of the
inference servers and of the router, and the `Successfully reset prefix cache` line of
every weight update; the engine's throughput lines stay. `show_all` prints everything.

The job's state comes from `state_fn` (default: `job.json`, which the job's supervisor
keeps current); nothing here asks SLURM.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO, Union

from prime_hpc.core.text import printable
from prime_hpc.rundir import COMPONENTS as RUN_COMPONENTS
from prime_hpc.rundir import RunDir, logtree, read_tail
from prime_hpc.rundir.jobs import COMPLETED, FINAL_STATES, PENDING, REQUEUED, read_job
from prime_hpc.sched.registry import of

# what to tail: the components, the router, the env servers and workers, the run's own teacher (servers, router)
COMPONENTS = (*RUN_COMPONENTS, "router", "envs", "teacher")
POLL_S = 0.5
ENDED_GRACE_S = 10.0  # a final state without `ended_at` (nobody left to write it) ends the follow after this
TAIL_WINDOW = 1 << 20  # bytes read from the end of a file for its last lines

Rank = Union[int, str]  # a global trainer rank, or "all"
StateFn = Callable[[], tuple[str, dict[str, Any]]]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_SGR = re.compile(r"\x1b\[[0-9;]*m")  # colours only
_NOISE = re.compile(
    r'INFO:\s+\S+ - "[A-Z]+ \S+ HTTP/[\d.]+" [23]\d\d\b'  # uvicorn access line of a successful request
    r"|\b(?:started|finished) processing request\b|\bHTTP request completed\b"  # the router, per request
    r"|Successfully reset prefix cache|prime-hpc inference: \S+ serves policy \d+ \(update"  # every weight update, on every server ...
    r"|Reloading and processing weights took|RotaryEmbedding: Failed to load weights"
)  # ... and its reload
_RANK_PREFIX = re.compile(r"\[[A-Za-z_][\w-]*?(\d+)\]:")  # torchrun: [<role><local rank>]:


# ----------------------------------------------------------------------------- pure helpers
def safe(text: str) -> str:
    """`text` as it may reach the terminal: colour sequences (SGR: the router's logs are
    coloured) dropped, every other control character but the tab written as `\\xNN`
    (`core.text.printable`)."""
    return printable(_SGR.sub("", text))


def is_noise(line: str) -> bool:
    """True for a line hidden by default: a successful request's access line (uvicorn's
    `INFO: <addr> - "POST /v1/chat/completions HTTP/1.1" 200 OK`, the router's
    per-request lines), `Successfully reset prefix cache` and a server's line for each
    weight update (`... serves policy N (update ...)`). Failed requests (4xx, 5xx)
    and the engine's `Avg prompt throughput` lines are kept."""
    return bool(_NOISE.search(_ANSI.sub("", line)))


def visible(line: str) -> str:
    """What a terminal shows of a line holding carriage returns (a progress bar redrawn
    in place): its last non-empty segment."""
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1] if parts else line.replace("\r", "")


def split_rank(line: str) -> tuple[Optional[int], str]:
    """(local rank, rest) of a torchrun-prefixed line `[default<l>]:...`; (None, line)
    for torchrun's own lines."""
    m = _RANK_PREFIX.match(line)
    return (int(m.group(1)), line[m.end() :]) if m else (None, line)


def parse_rank(value: Rank) -> Rank:
    """A rank option: a global rank (int >= 0) or "all" (usable as an argparse `type`)."""
    if str(value).strip().lower() == "all":
        return "all"
    rank = int(value)
    if rank < 0:
        raise ValueError(f"rank must be >= 0 or 'all', not {value!r}")
    return rank


def last_per_label(items: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """The last `n` (label, text) items of every label, in their original order."""
    seen: dict[str, int] = {}
    kept = []
    for label, text in reversed(items):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] <= n:
            kept.append((label, text))
    return kept[::-1]


# ----------------------------------------------------------------------------- job state
def job_state(run: RunDir) -> tuple[str, dict[str, Any]]:
    """The default `state_fn`: (state, job) from the run's job.json."""
    job = read_job(run)
    return str(job.get("state") or "UNKNOWN"), job


def job_id(job: dict[str, Any]) -> str:
    """The job's current SLURM id (or local-<id>), as job.json records it."""
    return str((job.get("job_ids") or ["?"])[-1])


def waiting_message(run: RunDir, state: str, job: dict[str, Any], logs: Optional[Path]) -> Optional[str]:
    """What the job waits for (None when it runs with logs, or ended)."""
    jid = job_id(job)
    if state == PENDING:
        warm = (job.get("pipeline") or {}).get("warmup") or {}
        why = f"waiting for job {warm['job_id']} to complete" if warm.get("job_id") else "waiting for the job to start"
        return f"job {jid} is pending ({why})"
    if state == REQUEUED:
        return f"job {jid} was requeued (waiting for its next attempt to start)"
    if logs is None and state not in FINAL_STATES:
        log = of(job).batch_log(run, jid)
        return f"job {jid} is {state}: waiting for its logs (until they exist, see {log})"
    return None


def final_line(state: str, job: dict[str, Any]) -> str:
    """`job <id> ended: <STATE>`, with the failure's component, reason and log if any."""
    line = f"job {job_id(job)} ended: {state}"
    failure = job.get("failure") or {}
    if state != COMPLETED and failure:
        reason = failure.get("reason") or f"exit code {failure.get('rc')}"
        line += f" ({failure.get('component', '?')}: {reason}; log: {failure.get('log', '?')})"
    return line


# ----------------------------------------------------------------------------- sources
@dataclass
class Source:
    """One log file being read: its path, the label of its lines, and for a trainer node
    log the node index (its lines carry torchrun's rank prefix)."""

    path: Path
    label: str
    node: Optional[int] = None
    pos: int = 0
    partial: bytes = b""

    def take(self, data: bytes) -> list[str]:
        """The complete lines of `data`, read at `pos` and appended to what was left of the
        last line; what follows the last newline is kept for the next read."""
        self.pos += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in complete]


def _listdir(path: Path) -> list[str]:
    """Sorted names in `path` ([] if it is not there yet)."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _indexed(directory: Path, prefix: str) -> list[int]:
    """The i of every `<prefix><i>.log` in `directory`, ascending."""
    found = [n[len(prefix) : -4] for n in _listdir(directory) if n.startswith(prefix) and n.endswith(".log")]
    return sorted(int(i) for i in found if i.isdigit())


def _env_sources(logs: Path) -> list[Source]:
    """The logs under `envs/<kind>/<env>/`, train envs first: each env's server log (when
    it runs in an env server), then its worker logs."""
    out = []
    root = logtree.env_logs_root(logs)
    for kind in sorted(_listdir(root), key=lambda k: (k != "train", k)):
        for env in _listdir(root / kind):
            server = logtree.env_server_log(logs, kind, env)
            if server.is_file():
                out.append(Source(server, f"env-server:{kind}/{env}"))
            for w in _indexed(logtree.env_log_dir(logs, kind, env), "env_worker_"):
                label = f"env:{kind}/{env}" + (f"[{w}]" if w else "")
                out.append(Source(logtree.env_worker_log(logs, kind, env, w), label))
    return out


def discover(logs: Path, components: Sequence[str] = COMPONENTS) -> list[Source]:
    """The log files of one attempt's tree `logs` that belong to `components`, in display
    order (orchestrator, inference nodes, router, trainer nodes, env servers and workers,
    teacher)."""
    found = []
    orchestrator = logtree.log_of(logs, "orchestrator")
    if "orchestrator" in components and orchestrator.is_file():
        found.append(Source(orchestrator, "orchestrator"))
    for name in _listdir(logs / "runs") if "orchestrator" in components else []:  # a job of several runs
        own = logtree.component_log(logtree.sub_run_logs(logs, name), "orchestrator")
        if own.is_file():
            found.append(Source(own, f"orchestrator[{name}]"))
    if "inference" in components:
        found += [
            Source(logtree.log_of(logs, "inference", i), f"inference[{i}]")
            for i in _indexed(logtree.group_log_dir(logs, "inference"), "node_")
        ]
    if "router" in components:
        found += [
            Source(logtree.log_of(logs, f"router_{i}"), "router" if i == 0 else f"router[{i}]")
            for i in _indexed(logtree.group_log_dir(logs, "inference"), "router_")
        ]
    if "trainer" in components:
        found += [
            Source(logtree.log_of(logs, "trainer", i), f"torchrun[{i}]", node=i)
            for i in _indexed(logtree.group_log_dir(logs, "trainer"), "node_")
        ]
    if "envs" in components:
        found += _env_sources(logs)
    if "teacher" in components:
        found += [
            Source(logtree.log_of(logs, "teacher", i), f"teacher[{i}]")
            for i in _indexed(logtree.group_log_dir(logs, "teacher"), "node_")
        ]
        router = logtree.log_of(logs, "teacher_router")
        if router.is_file():
            found.append(Source(router, "teacher-router"))
    return found


def extra_sources(run: RunDir) -> list[Source]:
    """The logs of the servers of the run's extra inference jobs (`prime-hpc scale`,
    `logs/extra/<id>/inference/node_<id>.<n>.log`, labelled `inference[<id>.<n>]`) that exist,
    of the jobs that had not ended when the current attempt started."""
    from prime_hpc.watch.extra_jobs import log_sources

    job = read_job(run)
    if not job.get("extra_jobs"):
        return []
    attempts = job.get("attempts") or [{}]
    since = attempts[-1].get("started_at")
    return [Source(path, label) for path, label in log_sources(run, job, since) if path.is_file()]


def nproc_per_node(logs: Path) -> Optional[int]:
    """Trainer ranks per node: torchrun makes one directory per local rank under
    `trainer/torchrun/<rdzv-id>_<suffix>/attempt_<r>/` on every node (None until then)."""
    root = logtree.torchrun_log_dir(logs)
    counts = [sum(1 for r in _listdir(root / d / a) if r.isdigit()) for d in _listdir(root) for a in _listdir(root / d)]
    return max(counts, default=0) or None


def read_lines(src: Source) -> list[str]:
    """The complete lines appended to `src` since its last read. The file is reopened on
    every read: on NFS, opening revalidates it."""
    try:
        with open(src.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < src.pos:  # truncated or replaced
                src.pos, src.partial = 0, b""
            f.seek(src.pos)
            data = f.read()
    except OSError:
        return []
    return src.take(data)


def latest_attempt(run: RunDir) -> Optional[Path]:
    """The tree `logs/latest` points at (None before the first attempt)."""
    if "latest" not in _listdir(run.logs_root):  # listing revalidates a cached lookup on NFS
        return None
    try:
        path = run.logs_root / os.readlink(run.latest_logs)
    except OSError:
        return None
    return path if path.is_dir() else None


# ----------------------------------------------------------------------------- printing
class Tail:
    """The sources of one attempt's tree, which of their lines are selected, and how they
    are printed (`<label> | <line>`, labels padded to the widest seen so far)."""

    def __init__(
        self,
        components: Sequence[str],
        rank: Rank,
        show_all: bool,
        out: TextIO,
        extra: Callable[[], list[Source]] = list,
    ) -> None:
        self.components, self.rank, self.show_all, self.out = tuple(components), rank, show_all, out
        self.extra = extra  # the servers of the run's extra inference jobs (outside the attempt's tree)
        self.logs: Optional[Path] = None
        self.sources: dict[Path, Source] = {}
        self.nproc: Optional[int] = None
        self.nproc_looked = 0.0  # when nproc_per_node was last looked for (once a second until found)
        self.width = 0
        self.waiting: Optional[str] = None

    def switch(self, logs: Optional[Path]) -> None:
        """Follow the tree `logs` from now on; print a separator naming its attempt."""
        self.logs, self.sources, self.nproc, self.nproc_looked = logs, {}, None, 0.0
        if logs is not None:
            self.note(f"==> {logs.name.replace('_', ' ')} ({logs}) <==")

    def note(self, line: str) -> None:
        """Print a line of tail's own (a separator, a state)."""
        self.out.write(safe(line) + "\n")
        self.out.flush()

    def wait_note(self, message: Optional[str]) -> None:
        """Print what the job waits for, once per change of it."""
        if message and message != self.waiting:
            self.note(message)
        self.waiting = message

    def emit(self, label: str, text: str) -> None:
        """Print a source's line under its label."""
        label = safe(label)
        self.width = max(self.width, len(label))
        self.out.write(f"{label:<{self.width}} | {safe(text)}\n")

    def _global_rank(self, node: int, local: int) -> int:
        """node * nproc_per_node + local (nproc_per_node looked up until torchrun made it)."""
        if node == 0:
            return local
        if self.nproc is None and self.logs is not None and time.monotonic() - self.nproc_looked >= 1:
            self.nproc, self.nproc_looked = nproc_per_node(self.logs), time.monotonic()
        return node * (self.nproc or 1) + local

    def _selected(self, node: int, local: Optional[int]) -> bool:
        """Whether trainer rank (node, local) is followed; local None: torchrun's own lines
        on that node, shown when it runs a followed rank."""
        if self.rank == "all":
            return True
        if local is not None:
            return self._global_rank(node, local) == self.rank
        return self._global_rank(node, 0) <= int(self.rank) < self._global_rank(node + 1, 0)

    def select(self, src: Source, line: str) -> Optional[tuple[str, str]]:
        """(label, text) to print for a line of `src`, or None if it is not shown."""
        line = visible(line)
        if not self.show_all and is_noise(line):
            return None
        if src.node is None:
            return src.label, line
        local, rest = split_rank(line)
        if not self._selected(src.node, local):
            return None
        return (src.label, line) if local is None else (f"trainer[{self._global_rank(src.node, local)}]", rest)

    def _print_last(self, src: Source, n: int) -> None:
        """Print the last `n` selected lines of `src` (per label) and read on from its end."""
        start, data = read_tail(src.path, TAIL_WINDOW)
        src.pos, src.partial = start, b""
        lines = src.take(data)[1 if start else 0 :]  # from mid-file, the first line is cut
        picked = [s for s in (self.select(src, line) for line in lines) if s]
        for label, text in last_per_label(picked, n):
            self.emit(label, text)

    def poll(self, initial_lines: Optional[int] = None) -> None:
        """Print what is new in every source, picking up files that appeared. A new file
        is printed from its start, or, on the first look at a tree (`initial_lines`
        given), only its last `initial_lines` lines."""
        if self.logs is None:
            return
        found = discover(self.logs, self.components) + (self.extra() if "inference" in self.components else [])
        new = [src for src in found if src.path not in self.sources]
        for src in new:
            self.sources[src.path] = src
            self.width = max(self.width, len(src.label))
        if initial_lines is not None:
            for src in new:
                self._print_last(src, initial_lines)
        for src in self.sources.values():
            for line in read_lines(src):
                picked = self.select(src, line)
                if picked:
                    self.emit(*picked)
        self.out.flush()

    def finish(self, state: str, job: dict[str, Any]) -> int:
        """Print the sources' unterminated last lines and the final state; the exit code."""
        for src in self.sources.values():
            picked = self.select(src, src.partial.decode(errors="replace")) if src.partial else None
            if picked:
                self.emit(*picked)
            src.partial = b""
        self.note(final_line(state, job))
        return 0 if state == COMPLETED else 1


# ----------------------------------------------------------------------------- follow
def follow(
    run: RunDir,
    *,
    components: Optional[Sequence[str]] = None,
    rank: Rank = 0,
    show_all: bool = False,
    once: bool = False,
    lines: int = 10,
    poll_s: float = POLL_S,
    state_fn: Optional[StateFn] = None,
    out: Optional[TextIO] = None,
) -> int:
    """Print the logs of `run`'s latest attempt and follow them until the job ends.

    components: any of COMPONENTS (orchestrator, inference, router, trainer, envs, teacher);
    default all. rank: the global trainer rank to show, or "all" (default 0). show_all:
    also the per-request noise (`is_noise`). lines: how many last lines of each source to
    print first. once: print those and the job's state, and return. state_fn: () ->
    (state, job dict), called once per poll (default: job.json). out: default stdout.

    While the job is pending or requeued, or has no logs yet, one line says what it waits
    for; when `logs/latest` moves to a new attempt a separator names it; when the state is
    final (and job.json has `ended_at`) the rest is printed with the final state.
    Returns 0 if the job COMPLETED (or, with `once`, still runs), 1 if it ended otherwise,
    130 when interrupted (the job goes on)."""
    out = out if out is not None else sys.stdout
    unknown = sorted(set(components or ()) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"unknown component(s) {', '.join(unknown)}; choose from {', '.join(COMPONENTS)}")
    tail = Tail(components or COMPONENTS, parse_rank(rank), show_all, out, extra=lambda: extra_sources(run))
    state_fn = state_fn or (lambda: job_state(run))
    try:
        state, job = state_fn()
        if once or (state in FINAL_STATES and job.get("ended_at")):
            return _snapshot(run, tail, state, job, lines)
        return _follow_live(run, tail, state_fn, lines, poll_s)
    except KeyboardInterrupt:
        tail.note("stopped following (the job goes on)")
        return 130


def _snapshot(run: RunDir, tail: Tail, state: str, job: dict[str, Any], lines: int) -> int:
    """The last `lines` lines of every source of the latest attempt, then the state."""
    logs = latest_attempt(run)
    tail.switch(logs)
    tail.poll(initial_lines=lines)
    if state in FINAL_STATES:
        return tail.finish(state, job)
    tail.note(waiting_message(run, state, job, logs) or f"job {job_id(job)} is {state}")
    return 0


def _follow_live(run: RunDir, tail: Tail, state_fn: StateFn, lines: int, poll_s: float) -> int:
    """Poll the state and the logs every `poll_s` until the job ended."""
    first, final_since = True, None
    while True:
        state, job = state_fn()
        logs = latest_attempt(run)
        if first or logs != tail.logs:
            tail.poll()  # the rest of the previous attempt
            tail.switch(logs)
        tail.wait_note(waiting_message(run, state, job, logs))
        tail.poll(initial_lines=lines if first else None)
        first = False
        if state not in FINAL_STATES:
            final_since = None
        else:
            final_since = final_since or time.monotonic()
            if job.get("ended_at") or time.monotonic() - final_since >= ENDED_GRACE_S:
                tail.poll()
                return tail.finish(state, job)
        time.sleep(poll_s)
