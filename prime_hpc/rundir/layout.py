"""The layout of the run directory: every shared path is a property or method of `RunDir`;
nobody else builds these strings (the job scripts render theirs from it too).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from prime_hpc.rundir.files import STABLE, TMP_PREFIX, atomic_write_json, is_stable, remove_marked, truncate_jsonl

COMPONENTS = ("orchestrator", "inference", "trainer")  # also the het group order (0, 1, 2)
# every group a job may have (3: a teacher the run starts itself), each with configs/<group>.yaml
GROUPS = (*COMPONENTS, "teacher")
CHECKPOINT_PARTS = ("trainer", "orchestrator")  # what a complete RL checkpoint step holds
BEAT_S = 5.0  # a running component's heartbeat is at most this old (plus one unit of its work)
DOCTOR_MARKER = ".prime-hpc-doctor"  # a preflight's directory: see `RunDir.doctor_marker`
# A server's slot: `<group>_<n>` for the server on node n of the run's own job,
# `<group>_<jobid>.<n>` for one on node n of another job of the run (`prime-hpc scale`).
# The groups of servers: the run's inference fleet, and the teacher it starts itself
# (`orchestrator.teacher.model`), each with its own router and membership.
SERVER_GROUP = "inference"
SERVER_GROUPS = ("inference", "teacher")
_SLOT = re.compile(r"(inference|teacher)_(?:(\d+)\.)?(\d+)")
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # a run of a job's runs/ (RunDir.sub_run)


@dataclass(frozen=True)
class Slot:
    """A parsed slot: the job it belongs to (None: the run's own job), its node there and
    the group of servers it is one of."""

    job_id: Optional[str]
    node: int
    group: str = SERVER_GROUP

    @property
    def name(self) -> str:
        return server_slot(self.node, self.job_id, self.group)


def server_slot(node: int, job_id: Optional[str] = None, group: str = SERVER_GROUP) -> str:
    """The slot of the server of `group` on `node` (of another job of the run: `job_id`)."""
    _server_group(group)
    return f"{group}_{job_id}.{int(node)}" if job_id else f"{group}_{int(node)}"


def _server_group(group: str) -> str:
    if group not in SERVER_GROUPS:
        raise ValueError(f"{group!r} is not a group of servers ({', '.join(SERVER_GROUPS)})")
    return group


def parse_slot(name: str) -> Optional[Slot]:
    """`<group>_<n>` or `<group>_<jobid>.<n>` (a file name's `.json` removed first) as a
    `Slot`; None for any other name."""
    m = _SLOT.fullmatch(name[:-5] if name.endswith(".json") else name)
    return Slot(m.group(2), int(m.group(3)), m.group(1)) if m else None


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


def _numbered(parent: Path, prefix: str, suffix: str = "") -> list[int]:
    """The n of every `<prefix><n><suffix>` entry of `parent`, ascending."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    numbers = (n[len(prefix) : len(n) - len(suffix)] for n in names if n.startswith(prefix) and n.endswith(suffix))
    return sorted(int(k) for k in numbers if k.isdigit())


def _slot_name(slot: "str | int", group: str = SERVER_GROUP) -> str:
    if isinstance(slot, int):
        return server_slot(slot, None, group)
    if parse_slot(slot) is None:
        raise ValueError(f"{slot!r} is not a server's slot (<group>_<n> or <group>_<jobid>.<n>)")
    return slot


@dataclass(frozen=True)
class RunDir:
    """Every path of one run. Construct with the run's `output_dir`; `group` names the
    servers its fleet paths are about (their slots, router and membership): the run's
    inference servers, or the teacher the run starts itself."""

    root: Path
    group: str = SERVER_GROUP

    def __init__(self, root: os.PathLike | str, group: str = SERVER_GROUP) -> None:
        object.__setattr__(self, "root", Path(root).expanduser().absolute())
        object.__setattr__(self, "group", _server_group(group))

    def of_group(self, group: str) -> "RunDir":
        """The same run, its fleet paths about the servers of `group`."""
        return RunDir(self.root, group)

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

    def sbatch_script(self, kind: str) -> Path:
        """`submit/<kind>.sbatch` (kind: rl | sft), the rendered SLURM script."""
        return self.submit_dir / f"{kind}.sbatch"

    def local_script(self, kind: str) -> Path:
        return self.submit_dir / f"{kind}.local.sh"

    @property
    def submitit_dir(self) -> Path:
        """submitit's folder: pickled head task, results, SLURM batch output."""
        return self.submit_dir / "submitit"

    @property
    def local_batch_log(self) -> Path:
        """`submit/local.out`: the local job script's own output (cluster=local); a
        backend's `batch_log` names the one of its jobs."""
        return self.submit_dir / "local.out"

    def slurm_batch_log(self, job_id: str) -> Path:
        """`submit/submitit/<job id>_batch.out`: a SLURM job's batch script output."""
        return self.submitit_dir / f"{job_id}_batch.out"

    @property
    def private_dir(self) -> Path:
        """`private/` (0700): what only the run's owner may read; `private/api_key` (0600)
        holds the job's key, written at submit (`prime_hpc.core.keyfile`)."""
        return self.root / "private"

    @property
    def key_file(self) -> Path:
        """`private/api_key`: the job's key (the user's, or the one made for the job)."""
        return self.private_dir / "api_key"

    @property
    def env_servers_dir(self) -> Path:
        """`private/envservers/`: the endpoint of each env server while it serves,
        `<kind>-<env>.json` (0600) {"url", "pid", "instance"}, removed when it stops."""
        return self.private_dir / "envservers"

    def env_server_endpoint(self, kind: str, env: str) -> Path:
        return self.env_servers_dir / f"{kind}-{env}.json"

    # --- extra inference jobs (`prime-hpc scale`): jobs of their own that outlive attempts
    def extra_script(self, index: int) -> Path:
        """`submit/inference_<k>.sbatch`: the script of the run's k-th extra inference job
        (k counts from 0 over the run: job.json's `extra_jobs`)."""
        return self.submit_dir / f"inference_{int(index)}.sbatch"

    @property
    def extra_logs_root(self) -> Path:
        """`logs/extra/`: the extra inference jobs' logs, apart from the attempts' trees (an
        extra job outlives a requeue of the run's job)."""
        return self.logs_root / "extra"

    def extra_job_logs(self, job_id: str) -> Path:
        """`logs/extra/<job id>/`: one extra job's logs, its servers' in
        `inference/node_<n>.log` (`node_log`) as in an attempt's tree."""
        return self.extra_logs_root / str(job_id)

    def extra_leave_request(self, job_id: str) -> Path:
        """`logs/extra/<job id>/leave`: written by an extra job's script when its servers
        must leave the run (its content: why); each of its servers watches for it. (Not a
        signal: SLURM signals every process of a step, vLLM's engine too, which would stop
        at once instead of finishing its requests.)"""
        return self.extra_job_logs(job_id) / "leave"

    def extra_batch_log(self, job_id: str) -> Path:
        """`logs/extra/<job id>.out`: an extra job's batch script output (SLURM writes it,
        the script renders it with `%j`)."""
        return self.extra_logs_root / f"{job_id}.out"

    # --- discovery and liveness
    @property
    def endpoints_dir(self) -> Path:
        return self.root / "endpoints"

    def inference_endpoint(self, slot: "str | int") -> Path:
        """`endpoints/<slot>.json` (an int: the run's own server on that node), published by
        the server once healthy, removed when it leaves."""
        return self.endpoints_dir / f"{_slot_name(slot, self.group)}.json"

    def server_slots(self) -> list[str]:
        """The slots with a published endpoint, the run's own job's first (by node), then
        the other jobs' (by job, node)."""
        try:
            names = os.listdir(self.endpoints_dir)
        except OSError:
            return []
        parsed = (parse_slot(n) for n in names if n.endswith(".json"))
        slots = [s for s in parsed if s is not None and s.group == self.group]
        return [s.name for s in sorted(slots, key=lambda s: (s.job_id is not None, int(s.job_id or 0), s.node))]

    def server_endpoints(self) -> dict[str, dict]:
        """{slot: endpoint record} of every published server (unreadable ones left out)."""
        out = {}
        for slot in self.server_slots():
            try:
                out[slot] = json.loads(self.inference_endpoint(slot).read_text())
            except (OSError, ValueError):
                continue
        return out

    # --- the inference fleet: one file per writer (docs/inference.md#the-fleet)
    @property
    def fleet_dir(self) -> Path:
        return self.root / "fleet"

    def fleet_process(self, slot: "str | int") -> Path:
        """`fleet/<slot>.json`: the server's process as its job's supervisor sees it (state
        starting | hung | lost, restarts, since, log); written by that supervisor only."""
        return self.fleet_dir / f"{_slot_name(slot, self.group)}.json"

    @property
    def fleet_membership(self) -> Path:
        """`fleet/membership.json`: which servers the orchestrator's weight relay loads and
        routes to (state loading weights | serving | removed, policy step, since); written
        by the relay only. The teacher's: `fleet/teacher_membership.json` (the orchestrator's,
        no weights)."""
        return self.fleet_dir / self._grouped("membership.json")

    RESTART_PREFIX = "restart_"

    def restart_request(self, slot: "str | int") -> Path:
        """`control/restart_<slot>.json`: the watchdog found the server hung; its
        supervisor kills it (and restarts it as a lost server)."""
        return self.control_dir / f"{self.RESTART_PREFIX}{_slot_name(slot, self.group)}.json"

    @property
    def router_endpoint(self) -> Path:
        """`endpoints/router.json`, the router in front of the group's servers (the
        teacher's: `endpoints/teacher_router.json`)."""
        return self.endpoints_dir / self._grouped("router.json")

    def _grouped(self, name: str) -> str:
        return name if self.group == SERVER_GROUP else f"{self.group}_{name}"

    @property
    def control_dir(self) -> Path:
        """Requests from the job's supervisor to the components of the current attempt."""
        return self.root / "control"

    @property
    def stall_record(self) -> Path:
        """`control/stall.json`: the stall the watchdog found (component, silence, log), for
        the supervisor's record of the attempt."""
        return self.control_dir / "stall.json"

    def failure_record(self, component: str) -> Path:
        """`control/failure_<component>.json` {"reason", "log"}: the one-line cause a
        component gave as it exited with an error, and the log to read first, for the
        supervisor's record of the attempt (`job.json` `failure`)."""
        return self.control_dir / f"failure_{component}.json"

    @property
    def rendezvous_dir(self) -> Path:
        """`rendezvous/` (0700, the user's alone): the file stores where a run's processes
        meet, which nobody else may read, plant or swap (`job.attempt rendezvous` makes it
        and empties it at the start of each attempt; `rundir.private`): the trainer's below,
        and on one host each weight group's, `weights_<hex>.store`
        (`inference.broadcast`)."""
        return self.root / "rendezvous"

    @property
    def trainer_rendezvous(self) -> Path:
        """`rendezvous/trainer_rendezvous.store`: where torchrun's agents meet (a file store
        on the shared filesystem: nothing listens, unlike torch's TCP store, which binds
        every interface and lets whoever holds its port in); per attempt."""
        return self.rendezvous_dir / "trainer_rendezvous.store"

    @property
    def trainer_process_group(self) -> Path:
        """`rendezvous/trainer_process_group.store`: the trainer ranks' process-group store
        (see `trainer_rendezvous`); per attempt."""
        return self.rendezvous_dir / "trainer_process_group.store"

    @property
    def checkpoint_request(self) -> Path:
        """`control/checkpoint.json` {"reason", "requested_at"}: the supervisor asks the
        trainer and the orchestrator to checkpoint the step they are at and exit (time
        limit, preemption, requeue)."""
        return self.control_dir / "checkpoint.json"

    SIGTERM_PREFIX = "sigterm_"

    def sigterm_marker(self, who: str) -> Path:
        """`control/sigterm_<who>` (who: host_pid): a component got a SIGTERM. When SLURM
        preempts a job with a grace time it signals the job's steps, not its batch script;
        the supervisor notices these markers and asks SLURM why."""
        return self.control_dir / f"{self.SIGTERM_PREFIX}{who}"

    def sigterm_markers(self) -> list[Path]:
        return sorted(self.control_dir.glob(f"{self.SIGTERM_PREFIX}*")) if self.control_dir.is_dir() else []

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

    def server_heartbeat(self, slot: "str | int") -> Path:
        """`heartbeats/<slot>` (`inference_<n>` is `heartbeat("inference", n)`)."""
        return self.heartbeats_dir / _slot_name(slot, self.group)

    def beat(self, component: str, rank: int = 0, **info: Any) -> None:
        """Record that `component` rank `rank` is alive (and, e.g., at which step). Written
        by the loop that does the work, at least every `BEAT_S` while it runs; with
        `progress_at` (the last time it got something done) and `waiting_on` (the
        component it waits for, if it only waits), the watchdog tells a stall from a wait."""
        self.beat_as(self.heartbeat(component, rank), **info)

    def beat_as(self, path: Path, **info: Any) -> None:
        """Write the heartbeat file `path` (`heartbeat(...)` or `server_heartbeat(slot)`)."""
        atomic_write_json(path, {"time": time.time(), "pid": os.getpid(), **info}, durable=False)

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

    @staticmethod
    def of_weights_step(path: Path) -> Optional[tuple["RunDir", int]]:
        """(run, step) when `path` is a run's `weights/step_<n>`, else None."""
        if path.parent.name == "weights" and path.name.startswith("step_") and path.name[5:].isdigit():
            return RunDir(path.parent.parent), int(path.name[5:])
        return None

    def weights_step(self, step: int) -> Path:
        return _step_dir(self.weights_dir, step)

    def weights_adapter(self, step: int) -> Path:
        """LoRA runs: the PEFT-layout adapter of step n (for vLLM `/v1/load_lora_adapter`)."""
        return self.weights_step(step) / "adapter"

    def weight_steps(self, stable_only: bool = True) -> list[int]:
        """Steps with weights on disk (by default only complete, `STABLE` ones), ascending.
        With `weights.transport=broadcast` only the checkpointed steps and the last one have
        them; `policy_steps` are all the policies the trainer made."""
        return _steps_in(self.weights_dir, require_stable=stable_only)

    def has_weights(self, step: int) -> bool:
        """Are the weights of `step` complete on disk (`weights/step_<step>/STABLE`)?"""
        return is_stable(self.weights_step(step))

    @property
    def sent_dir(self) -> Path:
        """`weights.transport=broadcast`: `sent/step_<n>.json`, one per policy the trainer
        sent to the servers over the network (none of it on disk)."""
        return self.root / "sent"

    def sent_step(self, step: int) -> Path:
        return self.sent_dir / f"step_{int(step)}.json"

    def sent_steps(self) -> list[int]:
        """Steps whose policy the trainer announced as sent by broadcast, ascending."""
        return _numbered(self.sent_dir, "step_", ".json")

    def policy_steps(self) -> list[int]:
        """Every policy the trainer made that is still listed: weights on disk or sent by
        broadcast, ascending (what the orchestrator's relay follows)."""
        return sorted(set(self.weight_steps()) | set(self.sent_steps()))

    @property
    def eval_dir(self) -> Path:
        """`prime-hpc eval`'s own server files and its results, `eval/step_<n>.json`."""
        return self.root / "eval"

    def eval_result(self, step: int) -> Path:
        return self.eval_dir / f"step_{int(step)}.json"

    def eval_samples(self, step: int) -> Path:
        """Every rollout of `eval_result(step)`, one JSON object a line (step 0: the base model)."""
        return self.eval_dir / f"step_{int(step)}.samples.jsonl"

    @property
    def serve_json(self) -> Path:
        """A serve job's endpoint while it serves (`prime_hpc.orchestrator.serve`): the
        router's OpenAI URL, the model, the variable holding the key; gone once it stops."""
        return self.root / "serve.json"

    @property
    def bench_json(self) -> Path:
        """A bench run's results (`prime_hpc.rundir.bench`): every benched part, merged."""
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

    def checkpoint_part_steps(self, parts: Sequence[str], complete: bool) -> list[int]:
        """Steps that have every one of `parts` (`complete`: marked complete, else there at
        all), ascending: every lookup of checkpoint parts is this one."""
        there: Callable[[Path], bool] = is_stable if complete else Path.is_dir
        return [
            s
            for s in _steps_in(self.checkpoints_dir, require_stable=False)
            if all(there(self.checkpoint_part(s, c)) for c in parts)
        ]

    def complete_checkpoint_steps(self, parts: Sequence[str] = CHECKPOINT_PARTS) -> list[int]:
        """Steps whose `parts` are all marked complete: by default the trainer's and the
        orchestrator's (an RL run); an SFT run has no orchestrator and asks for
        `parts=("trainer",)`."""
        return self.checkpoint_part_steps(parts, complete=True)

    def latest_checkpoint_step(self, parts: Sequence[str] = CHECKPOINT_PARTS) -> Optional[int]:
        steps = self.complete_checkpoint_steps(parts)
        return steps[-1] if steps else None

    def checkpoint_steps(self, component: str) -> list[int]:
        """Steps that have a `component` part at all (complete or not), ascending."""
        return self.checkpoint_part_steps((component,), complete=False)

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
        return _numbered(self.logs_root, "attempt_")

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

    # --- several runs in one job (trainer.max_concurrent_runs): each a run directory of its own
    @property
    def runs_dir(self) -> Path:
        """`runs/`: one directory per run of a job that trains several (`runs/<name>/`, the
        same layout as a run directory); a run is there once its trainer config is."""
        return self.root / "runs"

    def sub_run(self, name: str) -> "RunDir":
        """The run directory of run `name` of this job (`runs/<name>/`)."""
        if not RUN_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a run name (letters, digits, '.', '_', '-'; not starting with '.')")
        return RunDir(self.runs_dir / name)

    @property
    def run_json(self) -> Path:
        """`run.json` of a run of a job that trains several: how it ended, as its trainer
        recorded it ({"state": "ENDED" | "REFUSED", "step", "reason", "config_mtime_ns": of
        the trainer config it ended under; a rewritten config, a resume, makes it run again})."""
        return self.root / "run.json"

    def sub_runs(self) -> list[str]:
        """The runs of this job whose trainer config is written, by name."""
        try:
            names = sorted(os.listdir(self.runs_dir))
        except FileNotFoundError:
            return []
        return [
            n
            for n in names
            if RUN_NAME.fullmatch(n) and RunDir(self.runs_dir / n).component_config("trainer").is_file()
        ]

    # --- preflight (prime-hpc doctor): a run directory of its own under <run>/doctor/
    @property
    def doctor_run(self) -> "RunDir":
        return RunDir(self.root / "doctor")

    @property
    def doctor_marker(self) -> Path:
        """Of a preflight's directory (`doctor_run`): written there before anything else; a
        later `prime-hpc doctor` empties only a directory holding this user's marker."""
        return self.root / DOCTOR_MARKER

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
        only what `--dry-run` and `doctor` write, or the key kept by a submit that failed
        (never a job.json)."""
        launch_only = {"config.yaml", "configs", "submit", "doctor", "warmup", "private", ".job.json.lock"}
        try:
            return all(e.name in launch_only for e in os.scandir(self.root))
        except FileNotFoundError:
            return True

    def clear_after(self, step: int) -> list[Path]:
        """Before a resume from `step` (0: from scratch): remove rollouts, weights (and
        markers of policies sent, `sent/`) and checkpoints of later steps, `rollouts/DONE` and the control requests, and drop the
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
                    remove_marked(_step_dir(parent, s))
                    removed.append(_step_dir(parent, s))
        for s in self.sent_steps():  # policies sent by broadcast: the relay would wait for them
            if s > step:
                self.sent_step(s).unlink(missing_ok=True)
                removed.append(self.sent_step(s))
        for path in sorted(self.metrics_dir.glob("*.jsonl")) if self.metrics_dir.is_dir() else []:
            # from scratch, step 0's rows (the eval or validation before the first step) go too
            if truncate_jsonl(path, lambda row: step > 0 and int(row.get("step", 0)) <= step):
                removed.append(path)
        return removed

    def wipe(self) -> None:
        """Empty the run directory (clean_output_dir=true; a preflight's directory before
        each `doctor`): its markers first (`remove_marked`); raises what stopped it."""
        remove_marked(self.root, (STABLE, DOCTOR_MARKER), keep_root=True, check=True)
