"""The run directory: the only contract between the launcher, orchestrator, inference and
trainer. Every shared path is a property or method of `RunDir`; nobody else builds these
strings.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

STABLE = "STABLE"
TMP_PREFIX = ".tmp."
COMPONENTS = ("orchestrator", "inference", "trainer")  # also the het group order (0, 1, 2)
CHECKPOINT_PARTS = ("trainer", "orchestrator")  # what a complete RL checkpoint step holds
BEAT_S = 5.0  # a running component's heartbeat is at most this old (plus one unit of its work)


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


def _umask() -> int:
    """This process's umask now (it may change: submit applies `cluster.umask`), read
    without setting it where the kernel tells (/proc), which is safe with threads."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_mode() -> int:
    """0o666 minus the umask: what open() would give (mkstemp always gives 0o600, which
    would hide run files from teammates on the shared filesystem)."""
    return 0o666 & ~_umask()


def _dir_mode() -> int:
    """0o777 minus the umask: what mkdir() would give."""
    return 0o777 & ~_umask()


def atomic_write_bytes(path: os.PathLike | str, data: bytes, durable: bool = True) -> Path:
    """Write `data` to `path` so that a reader sees either nothing, the old content, or
    all of the new content: temp file in the same directory, fsync, `os.replace`.
    `durable=False` skips the fsyncs (file and directory): for records that are rewritten
    all the time and only advise (heartbeats, endpoints), where a crash of the node may
    lose the latest version but never tears one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
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
    os.chmod(staging, _dir_mode())  # mkdtemp makes 0700; some writers make 0600 files
    for p in staging.rglob("*"):
        os.chmod(p, _dir_mode() if p.is_dir() else _file_mode())
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
def _step_dir(parent: Path, step: int) -> Path:
    return parent / f"step_{int(step)}"


def _steps_in(parent: Path, require_stable: bool) -> list[int]:
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        if name.startswith("step_") and name[5:].isdigit():
            if not require_stable or is_stable(parent / name):
                steps.append(int(name[5:]))
    return sorted(steps)


@dataclass(frozen=True)
class RunDir:
    """Every path of one run. Construct with the run's `output_dir`."""

    root: Path

    def __init__(self, root: os.PathLike | str) -> None:
        object.__setattr__(self, "root", Path(root).expanduser().absolute())

    # --- launcher-owned
    @property
    def job_json(self) -> Path:
        return self.root / "job.json"

    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    @property
    def configs_dir(self) -> Path:
        return self.root / "configs"

    def component_config(self, component: str) -> Path:
        return self.configs_dir / f"{component}.yaml"

    @property
    def submit_dir(self) -> Path:
        return self.root / "submit"

    def sbatch_script(self, kind: str = "rl") -> Path:
        """`submit/<kind>.sbatch` (kind: rl | sft), the rendered SLURM script."""
        return self.submit_dir / f"{kind}.sbatch"

    def local_script(self, kind: str = "rl") -> Path:
        return self.submit_dir / f"{kind}.local.sh"

    @property
    def submitit_dir(self) -> Path:
        """submitit's folder: pickled head task, results, SLURM batch output."""
        return self.submit_dir / "submitit"

    def batch_log(self, job_id: str) -> Path:
        """The SLURM batch script's own output (before any component log exists)."""
        if str(job_id).startswith("local-"):
            return self.submit_dir / "local.out"
        return self.submitit_dir / f"{job_id}_batch.out"

    # --- discovery and liveness
    @property
    def endpoints_dir(self) -> Path:
        return self.root / "endpoints"

    def inference_endpoint(self, node: int) -> Path:
        return self.endpoints_dir / f"inference_{int(node)}.json"

    @property
    def router_endpoint(self) -> Path:
        return self.endpoints_dir / "router.json"

    @property
    def control_dir(self) -> Path:
        """Requests from the job's supervisor to the components of the current attempt."""
        return self.root / "control"

    @property
    def checkpoint_request(self) -> Path:
        """`control/checkpoint.json` {"reason", "requested_at"}: the supervisor asks the
        trainer and the orchestrator to checkpoint the step they are at and exit (time
        limit, preemption, requeue)."""
        return self.control_dir / "checkpoint.json"

    @property
    def checkpoint_answer(self) -> Path:
        """`control/checkpointed.json` {"step"}: the trainer's answer, the step it saved
        (the orchestrator then saves its own part of that step)."""
        return self.control_dir / "checkpointed.json"

    @property
    def heartbeats_dir(self) -> Path:  # per attempt: cleared when one starts
        return self.root / "heartbeats"

    def heartbeat(self, component: str, rank: int = 0) -> Path:
        return self.heartbeats_dir / f"{component}_{int(rank)}"

    def beat(self, component: str, rank: int = 0, **info: Any) -> None:
        """Record that `component` rank `rank` is alive (and, e.g., at which step). Written
        by the loop that does the work, at least every `BEAT_S` while it runs; with
        `progress_at` (the last time it got something done) and `waiting_on` (the
        component it waits for, if it only waits), the watchdog tells a stall from a wait."""
        atomic_write_json(self.heartbeat(component, rank), {"time": time.time(), "pid": os.getpid(), **info},
                          durable=False)

    def beats(self, component: Optional[str] = None) -> dict[str, dict]:
        """The heartbeats there are, {"trainer_0": {...}, ...} (of `component`'s ranks only
        if given); unreadable ones (being replaced) are left out."""
        out: dict[str, dict] = {}
        try:
            names = os.listdir(self.heartbeats_dir)
        except OSError:
            return out
        for n in names:
            if n.startswith(".") or (component and not n.startswith(component + "_")):
                continue
            try:
                out[n] = json.loads((self.heartbeats_dir / n).read_text())
            except (OSError, ValueError):
                continue
        return out

    # --- data plane
    @property
    def rollouts_dir(self) -> Path:
        return self.root / "rollouts"

    def rollout_step(self, step: int) -> Path:
        return _step_dir(self.rollouts_dir, step)

    def rollout_file(self, step: int, rank: int, ext: str = "pt") -> Path:
        return self.rollout_step(step) / f"rank_{int(rank)}.{ext}"

    @property
    def rollouts_done(self) -> Path:
        """`rollouts/DONE`: written (atomically, JSON {"last_step": n}) by the orchestrator
        when no rollouts after step n will come (data exhausted); the trainer stops there."""
        return self.rollouts_dir / "DONE"

    def rollout_steps(self) -> list[int]:
        """Steps with a complete (`STABLE`) rollout directory, ascending."""
        return _steps_in(self.rollouts_dir, require_stable=True)

    @property
    def weights_dir(self) -> Path:
        return self.root / "weights"

    def weights_step(self, step: int) -> Path:
        return _step_dir(self.weights_dir, step)

    def weights_adapter(self, step: int) -> Path:
        """LoRA runs: the PEFT-layout adapter of step n (for vLLM `/v1/load_lora_adapter`)."""
        return self.weights_step(step) / "adapter"

    def weight_steps(self, stable_only: bool = True) -> list[int]:
        """Steps with weights (by default only complete, `STABLE` ones), ascending."""
        return _steps_in(self.weights_dir, require_stable=stable_only)

    @property
    def eval_dir(self) -> Path:
        """`prime-hpc eval`'s own server files and its results, `eval/step_<n>.json`."""
        return self.root / "eval"

    def eval_result(self, step: int) -> Path:
        return self.eval_dir / f"step_{int(step)}.json"

    @property
    def bench_json(self) -> Path:
        """A bench run's results (`prime_hpc.bench`): every benched part, merged."""
        return self.root / "bench.json"

    def bench_part(self, part: str) -> Path:
        """One part's results (trainer | inference), written by that component."""
        return self.root / "bench" / f"{part}.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_step(self, step: int) -> Path:
        return _step_dir(self.checkpoints_dir, step)

    def checkpoint_part(self, step: int, component: str) -> Path:
        """`checkpoints/step_n/{trainer,orchestrator}/` (each with its own STABLE)."""
        return self.checkpoint_step(step) / component

    def complete_checkpoint_steps(self, parts: Sequence[str] = CHECKPOINT_PARTS) -> list[int]:
        """Steps whose `parts` are all marked complete: by default the trainer's and the
        orchestrator's (an RL run); an SFT run has no orchestrator and asks for
        `parts=("trainer",)`."""
        return [
            s
            for s in _steps_in(self.checkpoints_dir, require_stable=False)
            if all(is_stable(self.checkpoint_part(s, c)) for c in parts)
        ]

    def latest_checkpoint_step(self, parts: Sequence[str] = CHECKPOINT_PARTS) -> Optional[int]:
        steps = self.complete_checkpoint_steps(parts)
        return steps[-1] if steps else None

    def checkpoint_steps(self, component: str) -> list[int]:
        """Steps that have a `component` part at all (complete or not), ascending."""
        return [s for s in _steps_in(self.checkpoints_dir, require_stable=False)
                if self.checkpoint_part(s, component).is_dir()]

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def metrics(self, component: str) -> Path:
        return self.metrics_dir / f"{component}.jsonl"

    @property
    def wandb_dir(self) -> Path:
        """W&B's local files (offline runs, caches) stay inside the run directory."""
        return self.root / "wandb"

    # --- logs: one tree per attempt, logs/latest -> the current one
    @property
    def logs_root(self) -> Path:
        return self.root / "logs"

    @property
    def latest_logs(self) -> Path:
        return self.logs_root / "latest"

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs_root / f"attempt_{int(attempt)}"

    def attempts(self) -> list[int]:
        try:
            names = os.listdir(self.logs_root)
        except FileNotFoundError:
            return []
        return sorted(int(n[8:]) for n in names if n.startswith("attempt_") and n[8:].isdigit())

    def new_attempt(self) -> tuple[int, Path]:
        """Create the next `logs/attempt_<k>/` (never reusing one, even under races) and
        point `logs/latest` at it. Returns (k, path)."""
        self.logs_root.mkdir(parents=True, exist_ok=True)
        k = (self.attempts() or [-1])[-1] + 1
        while True:
            path = self.attempt_logs(k)
            try:
                path.mkdir()
                break
            except FileExistsError:
                k += 1
        link_tmp = self.logs_root / f"{TMP_PREFIX}latest.{os.getpid()}"
        try:
            link_tmp.unlink()
        except FileNotFoundError:
            pass
        link_tmp.symlink_to(path.name)
        os.replace(link_tmp, self.latest_logs)
        return k, path

    @staticmethod
    def component_log(logs: Path, component: str) -> Path:
        """`<attempt>/orchestrator.log`, `trainer.log`, `inference.log` (rank/node 0)."""
        return logs / f"{component}.log"

    @staticmethod
    def node_log(logs: Path, component: str, node: int) -> Path:
        return logs / component / f"node_{int(node)}.log"

    @staticmethod
    def router_log(logs: Path, index: int = 0) -> Path:
        return logs / "inference" / f"router_{int(index)}.log"

    @staticmethod
    def torchrun_log_dir(logs: Path) -> Path:
        return logs / "trainer" / "torchrun"

    @staticmethod
    def env_log_dir(logs: Path, kind: str, env: str) -> Path:
        return logs / "envs" / kind / env

    # --- preflight (prime-hpc doctor): a run directory of its own under <run>/doctor/
    @property
    def doctor_run(self) -> "RunDir":
        return RunDir(self.root / "doctor")

    @property
    def preflight_dir(self) -> Path:
        return self.root / "preflight"

    @property
    def preflight_head(self) -> Path:
        return self.preflight_dir / "head.json"

    def preflight_report(self, group: str, rank: int) -> Path:
        return self.preflight_dir / f"{group}_{int(rank)}.json"

    @property
    def preflight_summary(self) -> Path:
        return self.preflight_dir / "report.json"

    # --- lifecycle helpers
    def is_fresh(self) -> bool:
        """True when no run ever started here: the directory is missing, empty, or holds
        only what `--dry-run` and `doctor` write (never a job.json)."""
        launch_only = {"config.yaml", "configs", "submit", "doctor", "warmup", ".job.json.lock"}
        try:
            return all(e.name in launch_only for e in os.scandir(self.root))
        except FileNotFoundError:
            return True

    def clear_after(self, step: int) -> list[Path]:
        """Before a resume from `step` (0: from scratch): remove rollouts, weights and
        checkpoints of later steps, `rollouts/DONE` and the control requests, and drop the
        metrics rows of later steps, so a restarted run never consumes stale state and its
        metrics hold each step once. Returns what was removed or rewritten."""
        removed = []
        for marker in (self.rollouts_done, self.checkpoint_request, self.checkpoint_answer):
            if marker.exists():
                marker.unlink()
                removed.append(marker)
        for parent in (self.rollouts_dir, self.weights_dir, self.checkpoints_dir):
            for s in _steps_in(parent, require_stable=False):
                if s > step:
                    for marker in sorted(_step_dir(parent, s).rglob(STABLE)):  # first: never half-deleted yet marked
                        marker.unlink(missing_ok=True)
                    shutil.rmtree(_step_dir(parent, s), ignore_errors=True)
                    removed.append(_step_dir(parent, s))
        for path in sorted(self.metrics_dir.glob("*.jsonl")) if self.metrics_dir.is_dir() else []:
            # from scratch, step 0's rows (the eval or validation before the first step) go too
            if truncate_jsonl(path, lambda row: step > 0 and int(row.get("step", 0)) <= step):
                removed.append(path)
        return removed

    def wipe(self) -> None:
        """Empty the run directory (clean_output_dir=true)."""
        if self.root.exists():
            for entry in os.scandir(self.root):
                p = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(p)
                else:
                    p.unlink()
